"""An imported top-K store left unfinished by a stopped import: pre-flight refuses to train on it (training found it
only inside the flow, ~20 s later), training's list of candidates says it is unfinished, and once its staged work
is gone (an import of a changed source removes a dead import's staging) nothing can finish it, so that import
removes it too instead of leaving it `in progress` for good."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from support.import_sources import capture_table, import_config, write_parts

from kdflow.schemas.errors import ConfigError
from kdflow.schemas.owners import host_tag, process_alive
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.tasks.preflight import run_preflight
from kdflow.tasks.teacher.logit_import import import_store


def _import(config, source: Path) -> dict:
    return import_store(open_run_root(config), teacher_pass_settings(config), str(source), "kdflow", "t")


def _stopped(run: Path, tag: str) -> str:
    """Make the finished import of `tag` look like one killed before its last shard, its process gone: -> KEY."""
    store = run / "topk" / tag
    (store / "_complete.json").unlink()
    last = sorted(store.glob("shard-*.arrow"))[-1]
    last.unlink()
    next(store.glob(f"{last.stem}*.json")).unlink()
    key = json.loads((store / "_store.json").read_text())["imported"]["key"]
    gone = next(pid for pid in range(4_194_303, 1, -1) if not process_alive(pid))
    (run / "_imports" / key).mkdir(parents=True)
    (run / "_imports" / key / "_owner.txt").write_text(f"{gone}-{host_tag()}")
    return key


def test_an_unfinished_import_is_refused_by_pre_flight_and_removed_once_nothing_can_finish_it(
        make_config, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = capture_table(40, 20)
    run = tmp_path / "run"
    config = import_config(make_config, run, student__eval_shards=1)
    tag = _import(config, write_parts(tmp_path / "src", table, [20]))["tag"]
    _stopped(run, tag)

    trained = config.model_copy(update={"student": config.student.model_copy(update={"topk_tag": tag})})
    with pytest.raises(ConfigError) as error:
        run_preflight(trained, "train")
    assert str(error.value) == (f"top-K store {run / 'topk' / tag} is unfinished (3/4 shards): run the `kdflow store "
                                "import` that made it again to finish it before training on it")
    with pytest.raises(ConfigError, match=rf"top-K store {tag} \(unfinished: run its import again\) under .* was "
                                          r"imported for this token store"):
        run_preflight(config, "train")

    # The same tokens with other values: another source, another TAG; the dead import's staging goes, and so does
    # the store only it could have finished.
    values = [[[v - 0.01 for v in position] for position in row] for row in table.column("topk_logprobs").to_pylist()]
    changed = write_parts(tmp_path / "changed", table.set_column(2, "topk_logprobs", pa.array(values)), [20])
    summary = _import(config, changed)
    assert summary["complete"] and summary["tag"] != tag
    assert sorted(p.name for p in (run / "topk").iterdir()) == [summary["tag"]]
    assert f"removed top-K store {run / 'topk' / tag}, which that stopped import had begun" in caplog.text


def test_training_on_an_import_needs_only_the_teachers_tokenizer(make_config, tmp_path: Path,
                                                                 tiny_tokenizer_dir: Path) -> None:
    """Whoever imports a large teacher's capture rarely has its weights: training on it reads only the tokenizer,
    so `teacher.model` may name a folder of tokenizer files alone; what reads the teacher itself still needs it."""
    run = tmp_path / "run"
    config = import_config(make_config, run, student__eval_shards=1)
    tag = _import(config, write_parts(tmp_path / "src", capture_table(40, 20), [20]))["tag"]
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.run_status import status_lines

    assert f"  imported by kdflow store import from {tmp_path / 'src'}" in status_lines(RunRoot(str(run)))
    tokenizer_only = config.model_copy(update={"teacher": config.teacher.model_copy(
        update={"model": str(tiny_tokenizer_dir)}), "student": config.student.model_copy(update={"topk_tag": tag})})
    assert not (tiny_tokenizer_dir / "config.json").exists()
    run_preflight(tokenizer_only, "train")
    for stages, change in (("precompute", {}), ("train", {"prune": make_config(
            student__prune={"layers": 1}).student.prune})):
        changed = tokenizer_only.model_copy(update={"student": tokenizer_only.student.model_copy(update=change)})
        with pytest.raises(ConfigError, match=r"^teacher.model='.*' is not a model folder \(no config.json\)$"):
            run_preflight(changed, stages)
