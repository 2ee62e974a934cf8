"""Pre-flight for training alone (`--stages train` on a run root whose stores are made): the settings that only
the stores can judge are refused in one line before Prefect starts, not by the training inside it, and a training
that fails before writing anything leaves no empty student folder behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kdflow.schemas.config_io import dump_config
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.tasks.preflight import run_preflight


@pytest.mark.parametrize(("overrides", "message", "with_precompute"), [
    # the token store is not made again by precompute,train: the teacher pass ran in full, then training refused
    ({"student__eval_shards": 99}, "student.eval_shards=99 leaves no training shard: the token store has ", True),
    ({"precompute__top_k": 3}, "shard-00000.arrow has K=8, precompute.top_k is 3", False),
    ({"student__topk_tag": "nope"}, "student.topk_tag='nope': no such top-K store under ", False),
])
def test_training_alone_is_refused_before_the_stages(fresh_run, overrides: dict, message: str,
                                                     with_precompute: bool) -> None:
    config = fresh_run(**overrides)
    for stages in ("train", "precompute,train")[:1 + with_precompute]:
        with pytest.raises(ConfigError) as caught:
            run_preflight(config, stages)
        assert message in str(caught.value) and "\n" not in str(caught.value)
    if not with_precompute:
        run_preflight(config, "precompute,train")  # the top-K store is made again first: nothing to judge yet
    run_preflight(config, "tokenise,precompute,train")  # every store is made again first
    assert run_preflight(fresh_run(), "train") == []


def test_a_training_that_fails_before_writing_leaves_no_student_folder(fresh_run) -> None:
    """(The lease's folder was left empty, and `kdflow status` listed the student as 'no checkpoint yet'.)"""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = fresh_run(student__name="never", student__topk_tag="nope")
    with pytest.raises(StoreError, match="student.topk_tag='nope': no such top-K store"):
        train(open_run_root(config), training_settings(config))
    assert not (Path(config.run_root) / "students" / "never").exists()


def test_a_token_store_of_no_sequence_is_named_before_the_teacher_pass(sharp_teacher_dir, tmp_path) -> None:
    """One short document gives a token store of no sequence. `--stages precompute,train` then ran the teacher pass
    and training said "token store ... lacks shard(s) all; run tokenise first", after tokenise had run."""
    from support.corpus import write_jsonl
    from support.runs import make_tokens, run_config

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_stores

    config = run_config(tmp_path / "run", sharp_teacher_dir, write_jsonl(tmp_path / "docs.jsonl", ["hello there"]))
    make_tokens(config)
    for stages in ("precompute,train", "train"):
        with pytest.raises(ConfigError, match="^the token store holds no sequence: the corpus gave fewer tokens"):
            run_preflight(config, stages)
    with pytest.raises(StoreError, match="tokens: the token store holds no sequence") as caught:
        open_stores(open_run_root(config), training_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    assert "lacks" not in str(caught.value)


def test_a_student_whose_checkpoints_cannot_resume_is_refused_before_the_stages(tmp_path, tiny_teacher_dir) -> None:
    """The config beside the student (written once a run's checkpoints resume with it) against this one: each
    setting of a checkpoint's fingerprint that differs, in one line, not after the stages before training."""
    from support.runs import trained_tiny_run

    from kdflow.schemas.config_io import config_from_dict, set_dotted
    from kdflow.schemas.errors import StoreError
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = trained_tiny_run(tmp_path, tiny_teacher_dir)
    student = Path(config.run_root) / "students" / config.student.name

    def changed(**overrides: Any) -> Any:
        data = config.model_dump(mode="json")
        for key, value in overrides.items():
            set_dotted(data, key.replace("__", "."), value)
        return config_from_dict(data)

    assert run_preflight(changed(student__steps=5, student__save_every=1, student__eval_every=1), ["train"]) == []
    with pytest.raises(ConfigError) as caught:
        run_preflight(changed(seq_len=16, student__lr=0.02), ["train"])
    assert str(caught.value).startswith(f"student.name='{config.student.name}': its checkpoints (up to checkpoint-")
    assert str(caught.value).endswith(") were trained with student.lr 0.01, now 0.02; seq_len 32, now 16, so they "
                                      f"cannot resume: choose another student.name, or delete {student}")
    with pytest.raises(ConfigError, match=r"trained with student\.architecture\.hidden_size 32, now 16, so they "):
        run_preflight(changed(student__architecture__hidden_size=16), ["train"])  # the key, not both sections
    fewer_ids = changed(precompute__top_k=4)
    pytest.raises(ConfigError, run_preflight, fewer_ids, ["train"]).match(r"has K=8, precompute.top_k is 4$")
    with pytest.raises(ConfigError, match="precompute.top_k 8, now 4"):
        run_preflight(fewer_ids, ["precompute", "train"])  # it would train on the one precompute makes
    # Training refuses it too, and leaves the config beside the student as it was: the next try is refused again.
    faster = changed(student__lr=0.02)
    with pytest.raises(StoreError, match="was trained with other data or settings"):
        train(open_run_root(faster), training_settings(faster))
    assert (student / "config.yaml").read_text() == dump_config(config)
    with pytest.raises(ConfigError, match="student.lr 0.01, now 0.02"):
        run_preflight(changed(student__lr=0.02), ["train"])
    longer = changed(student__steps=4)
    train(open_run_root(longer), training_settings(longer))
    assert (student / "config.yaml").read_text() == dump_config(longer)


def test_settings_that_change_nothing_are_said_not_ignored_in_silence(fresh_run, caplog) -> None:
    """Fewer steps than a student has trained leave it as it is; more calibration rows than the store has measure
    on those it has. (A pruned student ignores student.architecture without a word: the demo's config holds both,
    the architecture for `--quick`.)"""
    import logging

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    pruned = fresh_run(student__prune={"layers": 1, "calibration_rows": 10_000})
    with caplog.at_level(logging.WARNING, logger="kdflow"):
        train(open_run_root(pruned), training_settings(pruned), on_step=lambda record: record["step"] == 2)
    assert "student.prune.calibration_rows=10000, but the token store has " in caplog.text
    caplog.clear()
    fewer = fresh_run(student__prune={"layers": 1, "calibration_rows": 10_000}, student__steps=1)
    with caplog.at_level(logging.WARNING, logger="kdflow"):
        summary = train(open_run_root(fewer), training_settings(fewer))
    assert summary["start_step"] == 2 and summary["steps"] == 2
    assert "student.steps=1, but 2 steps are trained already: it stays the step-2 model" in caplog.text
