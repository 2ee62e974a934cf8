"""Pre-flight for training alone (`--stages train` on a run root whose stores are made): the settings that only
the stores can judge are refused in one line before Prefect starts, not by the training inside it, and a training
that fails before writing anything leaves no empty student folder behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.tasks.preflight import run_preflight


@pytest.mark.parametrize(("overrides", "message"), [
    ({"student__eval_shards": 99}, "student.eval_shards=99 leaves no training shard: the token store has "),
    ({"precompute__top_k": 3}, "shard-00000.arrow has K=8, precompute.top_k is 3"),
    ({"student__topk_tag": "nope"}, "student.topk_tag='nope': no such top-K store under "),
])
def test_training_alone_is_refused_before_the_stages(fresh_run, overrides: dict, message: str) -> None:
    config = fresh_run(**overrides)
    with pytest.raises(ConfigError) as caught:
        run_preflight(config, "train")
    assert message in str(caught.value) and "\n" not in str(caught.value)
    run_preflight(config, "precompute,train")  # the stores are made again first: nothing to judge yet
    assert run_preflight(fresh_run(), "train") == []


def test_a_training_that_fails_before_writing_leaves_no_student_folder(fresh_run) -> None:
    """(The lease's folder was left empty, and `kdflow status` listed the student as 'no checkpoint yet'.)"""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = fresh_run(student__name="never", student__topk_tag="nope")
    with pytest.raises(StoreError, match="student.topk_tag='nope': no such top-K store"):
        train(open_run_root(config), training_settings(config))
    assert not (Path(config.run_root) / "students" / "never").exists()
