"""The teacher's benchmarks run end to end on CPU: `kdflow bench teacher-pass` and `kdflow bench scale` (the GPU
check's rehearsal is in test_gpu_check.py).
Their numbers are their output, not asserted here; what is asserted is that every part ran and reported."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.runs import prepare

from kdflow.schemas.config_io import dump_config


@pytest.mark.parametrize("targets", ["topk", "hybrid"])
def test_bench_teacher_pass_times_every_mode_and_leaves_the_run_root_alone(
        make_config: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], targets: str) -> None:
    from kdflow.bench.teacher_pass import MODES, main, scratch_copy
    from kdflow.tasks.teacher.loading import load_teacher_config
    from kdflow.tasks.teacher.sampled_pass import sampled_chunk_tokens
    from kdflow.tasks.teacher.topk import choose_chunk_tokens

    config = prepare(make_config(dataset__max_documents=12, precompute__targets=targets,
                                 precompute__chunk_memory_mib=1, precompute__sampling__head=4))
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config), encoding="utf-8")
    capsys.readouterr()
    assert main(["--config", str(path), "--shards", "2", "--repeats", "1", "--threads", "1"]) == 0
    *modes, ratios = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [m["mode"] for m in modes] == list(MODES)
    # the `topk` mode runs the step of the config's targets (a hybrid config's pass runs the sampler, not the top-K)
    vocab = load_teacher_config(config.teacher).vocab_size
    chunk = choose_chunk_tokens(vocab, 1 << 20) if targets == "topk" else sampled_chunk_tokens(config.precompute, vocab)
    assert all(m["targets"] == targets and m["chunk_tokens"] == chunk for m in modes)
    assert all(m["tokens_per_s"] > 0 and m["tokens"] == modes[0]["tokens"] > 0 for m in modes)
    assert modes[0]["micro_batches"] == 4 and modes[0]["padded_tokens"] == 4 * 4 * 32  # 2 shards of 8 rows, 4 a batch
    assert set(ratios) >= {"stage/forward", "topk/forward", "stage/body", "topk/body", "stage/topk"}
    stage = modes[-1]  # where the stage's time went: the writer's busy seconds lie inside the call's
    assert 0 < stage["writer_busy_s"] <= stage["call_s"] <= stage["seconds_best"] + 0.05
    assert stage["waited_for_writer_s"] >= 0 and stage["shards_tokens_per_s"] >= stage["tokens_per_s"]
    assert list(stage["phases_s"]) == ["plan", "setup", "shards", "finish"]  # the call's seconds, phase by phase
    assert sum(stage["phases_s"].values()) == pytest.approx(stage["call_s"], abs=0.01)
    assert not (Path(config.run_root) / "topk").exists()  # the stage computed in a scratch copy
    assert config.precompute.report_rows > 0  # the pass's store report: not part of what the stage times
    assert scratch_copy(config, 1, str(tmp_path / "scratch"))[0].precompute.report_rows == 0


def test_the_stage_keeps_only_the_renumbering_tables_between_rounds(tmp_path: Path) -> None:
    from kdflow.bench.teacher_pass import empty_store
    from kdflow.schemas.layout import RENUMBERING_FILE

    for name in ("_store.json", "_complete.json", "shard-00000.arrow", "shard-00000.commit.json", RENUMBERING_FILE):
        (tmp_path / "topk" / "tag").mkdir(parents=True, exist_ok=True)
        (tmp_path / "topk" / "tag" / name).write_bytes(b"x")
    (tmp_path / "topk" / "other").mkdir()
    (tmp_path / "topk" / "other" / "shard-00000.arrow").write_bytes(b"x")
    empty_store(tmp_path / "topk")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "topk", "topk/tag", f"topk/tag/{RENUMBERING_FILE}"]


def test_bench_scale_repeats_only_full_shards_under_their_own_ids(make_config: Callable[..., Any],
                                                                  tmp_path: Path) -> None:
    """`kdflow bench scale --teacher-tokens`: a run larger than what the teacher computed repeats its full shards
    (never the short last one), each under its own id and commit record, and the copy validates as a run root."""
    from kdflow.bench.scale import subset_run
    from kdflow.commands.validate import validate_run_root
    from kdflow.schemas.commits import list_commits, read_complete
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.teacher.precompute import precompute_shards

    config = prepare(make_config(dataset__max_documents=12))
    precompute_shards(open_run_root(config), teacher_pass_settings(config))
    full = Path(config.run_root)
    computed = list_commits(RunRoot(str(full)), str(full / "tokens"), "tokens")
    rows = [computed[i].rows for i in sorted(computed)]
    assert len(rows) >= 2 and rows[-1] < rows[0]  # the teacher's token store ends with a short shard
    info = subset_run(full, tmp_path / "larger", 3 * len(rows))
    copy = RunRoot(str(tmp_path / "larger"))
    records = list_commits(copy, str(tmp_path / "larger" / "tokens"), "tokens")
    assert sorted(records) == list(range(3 * len(rows))) and {r.rows for r in records.values()} == {rows[0]}
    assert info["tokens"] == 3 * len(rows) * rows[0] * config.seq_len
    assert read_complete(copy, str(tmp_path / "larger" / "tokens")).shards == 3 * len(rows)
    assert validate_run_root(str(tmp_path / "larger")) == 0
