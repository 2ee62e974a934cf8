"""`kdflow tune precompute`: candidates in fresh processes, failures kept to their candidate, the recommendation,
`--write` editing the YAML in place, and the bad inputs refused before any process starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.runs import prepare

import kdflow.tasks.common.launch as launch
from kdflow.cli import main as cli_main
from kdflow.schemas.config_io import dump_config
from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.tasks.teacher import tune_search
from kdflow.tasks.teacher.tune_file import set_nested_value, write_micro_batch
from kdflow.tasks.teacher.tune_trial import measure_candidate

REPO = Path(__file__).resolve().parents[1]


def config_yaml(config: Any, path: Path, *, drop: tuple[str, ...] = (), comment: bool = True) -> Path:
    """The config as a YAML file a user would write: with comments, and without the keys in `drop`."""
    data = yaml.safe_load(dump_config(config))
    for key in drop:
        data.pop(key)
    text = yaml.safe_dump(data, sort_keys=False)
    if comment:
        text = "# my run: keep this comment\n" + text.replace("  micro_batch: 4\n",
                                                              "  micro_batch: 4   # tuned by hand\n")
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any child process started from here on fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = cli_main(["tune", "precompute", *args])
    return code, capsys.readouterr().err.strip().splitlines()


# ---- bad input: one line, exit 2, no process ----------------------------------------------------------------


@pytest.mark.parametrize("sizes, message", [
    ("", "the micro-batch list is empty: give sizes such as --micro-batches 8,14,28,56"),
    (" , ", "the micro-batch list is empty: give sizes such as --micro-batches 8,14,28,56"),
    ("8,0", "micro-batch 0 must be >= 1"),
    ("-4", "micro-batch -4 must be >= 1"),
    ("8,a", "micro-batch 'a' is not an integer (expected sizes such as 8,14,28,56)"),
])
def test_a_bad_micro_batch_list_is_one_line(make_config: Callable[..., Any], tmp_path: Path, no_process: None,
                                            capsys: pytest.CaptureFixture[str], sizes: str, message: str) -> None:
    path = config_yaml(make_config(), tmp_path / "c.yaml")
    assert run_cli(capsys, str(path), f"--micro-batches={sizes}") == (2, [f"kdflow: error: {message}"])


def test_a_teacher_that_cannot_load_is_one_line(make_config: Callable[..., Any], tmp_path: Path, no_process: None,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = config_yaml(make_config(teacher__model=str(tmp_path / "nowhere")), tmp_path / "missing.yaml")
    assert run_cli(capsys, str(missing)) == (
        2, [f"kdflow: error: teacher.model='{tmp_path / 'nowhere'}': model path does not exist: "
            f"{tmp_path / 'nowhere'}"])
    broken = tmp_path / "broken-teacher"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}', encoding="utf-8")
    code, lines = run_cli(capsys, str(config_yaml(make_config(teacher__model=str(broken)), tmp_path / "broken.yaml")))
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"kdflow: error: teacher.model='{broken}' ")
    weightless = tmp_path / "weightless-teacher"
    weightless.mkdir()
    shutil.copy(Path(make_config().teacher.model) / "config.json", weightless / "config.json")
    assert run_cli(capsys, str(config_yaml(make_config(teacher__model=str(weightless)), tmp_path / "w.yaml"))) == (2, [
        f"kdflow: error: teacher.model='{weightless}' holds no model weights (no *.safetensors or *.bin file)"])
    too_long = config_yaml(make_config(seq_len=4096), tmp_path / "long.yaml")
    assert run_cli(capsys, str(too_long)) == (
        2, ["kdflow: error: seq_len=4096 exceeds the teacher's context length (max_position_embeddings=256)"])


def test_no_token_shards_and_no_seq_len_is_one_line(make_config: Callable[..., Any], tmp_path: Path, no_process: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = make_config(seq_len=64)
    path = config_yaml(config, tmp_path / "c.yaml", drop=("seq_len",))
    assert run_cli(capsys, str(path)) == (2, [
        f"kdflow: error: no token shards in {Path(config.run_root) / 'tokens'} and no seq_len in the config: "
        "set seq_len (tokens of that length are made up from Python's documentation) or run tokenise first"])


def test_token_shards_of_another_length_and_a_run_under_way_are_refused(
        make_config: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = prepare(make_config(dataset__max_documents=12))
    with pytest.raises(KDFlowError, match="have seq_len 32, the config says 64"):
        longer = config.model_copy(update={"seq_len": 64})
        tune_search.check_tune_inputs(open_run_root(longer), teacher_pass_settings(longer))
    from kdflow.tasks.teacher.precompute import precompute_shards

    precompute_shards(open_run_root(config), teacher_pass_settings(config), [0])
    path = config_yaml(config, tmp_path / "c.yaml")
    capsys.readouterr()  # the stages' own progress lines
    code, lines = run_cli(capsys, str(path), "--write")
    assert code == 2 and lines == ["kdflow: error: --write: this config's top-K store already has shards computed with "
                                   "micro_batch 4; the micro-batch stays fixed for a run (tune without --write)"]


# ---- the recommendation and the loop, on given outcomes -------------------------------------------------------


def ok(size: int, rate: float, headroom: float) -> tune_search.Candidate:
    return tune_search.Candidate(size, "ok", 0, "", {"tokens_per_s": rate, "headroom": headroom, "memory": "cpu rss",
                                                "peak_rss_mib": 100.0 * size, "total_mib": 1000.0})


def test_the_recommendation_is_the_fastest_that_leaves_the_headroom() -> None:
    candidates = [ok(4, 900.0, 0.5), ok(8, 1000.0, 0.3), ok(16, 1100.0, 0.05),
                  tune_search.Candidate(32, "out of memory", 75, "CUDA out of memory")]
    assert tune_search.recommend(candidates, 0.10).micro_batch == 8
    assert tune_search.recommend(candidates, 0.01).micro_batch == 16
    assert tune_search.recommend(candidates, 0.60) is None
    result = tune_search.summary(candidates, 0.10)
    assert (result["recommended_micro_batch"], result["fastest_micro_batch"]) == (8, 16)
    assert result["recommended_over_fastest"] == round(1000 / 1100, 4)
    text = tune_search.table(candidates, 0.10)
    assert "<- recommended" in text.splitlines()[2] and "below headroom" in text.splitlines()[3]
    assert "out of memory (exit 75)" in text.splitlines()[4]


def test_after_an_out_of_memory_larger_candidates_are_skipped_other_failures_do_not_stop() -> None:
    outcomes = {2: tune_search.Candidate(2, "failed", 71, "CUDA driver error: device not ready"), 4: ok(4, 10.0, 0.5),
                8: tune_search.Candidate(8, "out of memory", 75, "CUDA out of memory"), 16: ok(16, 99.0, 0.5)}
    ran: list[int] = []

    def runner(size: int) -> tune_search.Candidate:
        ran.append(size)
        return outcomes[size]

    results = tune_search.run_candidates([16, 2, 8, 4], runner)
    assert ran == [2, 4, 8] and [c.status for c in results] == ["failed", "ok", "out of memory", "skipped"]
    assert results[3].message == "micro-batch 8 ran out of memory"
    ran.clear()
    assert [c.status for c in tune_search.run_candidates([2, 4, 8, 16], runner, keep_going=True)][-1] == "ok"
    with pytest.raises(ConfigError, match="bad teacher"):
        tune_search.run_candidates([1], lambda size: tune_search.Candidate(size, "failed", 2, "bad teacher"))


# ---- --write: one value edited in place -----------------------------------------------------------------------


def test_write_replaces_the_value_and_keeps_comments(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    original = ("# top comment\nrun_root: runs/x   # where\nprecompute:\n  # the teacher's batch\n"
                "  top_k: 32\n  micro_batch: 8    # tuned by hand\n  sequences_per_shard: 32\n"
                "student:\n  micro_batch: 3\n")
    path.write_text(original, encoding="utf-8")
    write_micro_batch(path, 28)
    assert path.read_text(encoding="utf-8") == original.replace("  micro_batch: 8    # tuned",
                                                                "  micro_batch: 28    # tuned")


def test_write_inserts_a_missing_key_or_section_and_refuses_flow_style(tmp_path: Path) -> None:
    assert set_nested_value("precompute:\n    top_k: 32\nseq_len: 64\n", "precompute", "micro_batch", 14) == \
        "precompute:\n    micro_batch: 14\n    top_k: 32\nseq_len: 64\n"
    assert set_nested_value("seq_len: 64  # short\n", "precompute", "micro_batch", 14) == \
        "seq_len: 64  # short\nprecompute:\n  micro_batch: 14\n"
    path = tmp_path / "flow.yaml"
    path.write_text("precompute: {top_k: 32, micro_batch: 8}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="cannot edit .* in place; set precompute.micro_batch: 14 there by hand"):
        write_micro_batch(path, 14)
    assert path.read_text(encoding="utf-8") == "precompute: {top_k: 32, micro_batch: 8}\n"


# ---- real candidates ---------------------------------------------------------------------------------------------


def test_one_candidate_in_process_reads_the_runs_token_shards(make_config: Callable[..., Any]) -> None:
    config = prepare(make_config(dataset__max_documents=12))
    record = measure_candidate(open_run_root(config), teacher_pass_settings(config), micro_batch=3, batches=2)
    assert record["status"] == "ok" and record["tokens"] == 2 * 3 * 32 and record["tokens_per_s"] > 0
    assert record["rows_from"].startswith("token shards in ") and record["memory"] == "cpu rss"
    assert 0 < record["peak_rss_mib"] < record["total_mib"] and 0 < record["headroom"] < 1


@pytest.mark.parametrize("targets", ["topk", "hybrid"])
def test_both_heads_are_timed_and_the_tiled_one_checked_against_the_slab_loop(make_config: Callable[..., Any],
                                                                              targets: str) -> None:
    from kdflow.tasks.teacher.tune_heads import HEAD_TOLERANCE, measure_heads

    config = prepare(make_config(dataset__max_documents=12, precompute__targets=targets,
                                 precompute__sampling__head=4, precompute__sampling__samples=6))
    outcome = measure_heads(open_run_root(config), teacher_pass_settings(config), micro_batch=3, batches=1)
    slab, tiled, gemm = outcome["heads"]
    assert (slab["head"], slab["runs"], tiled["head"], tiled["runs"]) == ("slab", "slab", "tiled", "tiled")
    assert gemm["head"] == "tiled-gemm" and "skipped" in gemm  # a CUDA kernel: on a CPU it would time tiled again
    assert tiled["correct"] and tiled["max_logprob_diff"] <= HEAD_TOLERANCE and tiled["max_tail_diff"] <= HEAD_TOLERANCE
    assert tiled["ids_agree"] > 0.99 and slab["tokens_per_s"] > 0 and tiled["tokens_per_s"] > 0
    assert outcome["recommended_head"] == max([slab, tiled], key=lambda r: r["tokens_per_s"])["head"]


def test_the_head_chosen_is_the_fastest_that_matched_and_really_ran_tiled() -> None:
    from kdflow.tasks.teacher.tune_heads import choose_head

    slab = {"head": "slab", "runs": "slab", "tokens_per_s": 100.0}
    assert choose_head([slab, {"head": "tiled", "runs": "tiled-triton", "tokens_per_s": 300.0, "correct": True}]) \
        == "tiled"
    assert choose_head([slab, {"head": "tiled", "runs": "tiled", "tokens_per_s": 300.0, "correct": False}]) == "slab"
    assert choose_head([slab, {"head": "tiled", "runs": "slab", "tokens_per_s": 101.0, "correct": True}]) == "slab"
    assert choose_head([slab, {"head": "tiled", "runs": "tiled", "tokens_per_s": 90.0, "correct": True}]) == "slab"
    gemm = {"head": "tiled-gemm", "runs": "tiled-gemm", "tokens_per_s": 400.0, "correct": True}
    assert choose_head([slab, gemm]) == "tiled-gemm"
    assert choose_head([slab, gemm | {"runs": "tiled"}]) == "slab"  # the GEMM's fallback is the tiled head's
    assert choose_head([slab, {"head": "tiled-gemm", "runs": "tiled", "skipped": "runs as tiled here"}]) == "slab"


def test_a_teacher_with_a_final_logit_transform_runs_the_slab_loop_under_either_head(tmp_path: Path) -> None:
    """The tiled head needs the plain logits: a Gemma-2 teacher (its final soft-capping) runs the slab loop, and
    the trial says so."""
    import dataclasses

    import torch
    from support.tiny import tiny_config as run_config
    from transformers import AutoModelForCausalLM, Gemma2Config

    from kdflow.schemas.stage_settings import teacher_pass_settings as settings_of
    from kdflow.tasks.teacher.tune_heads import head_targets

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, head_dim=16, final_logit_softcapping=1.5)).eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    base = settings_of(run_config(tmp_path / "run", tmp_path / "teacher", tmp_path / "corpus.jsonl"))
    ran = {}
    for head in ("slab", "tiled"):
        settings = dataclasses.replace(base, precompute=base.precompute.model_copy(update={"head": head}))
        ran[head], (top_ids, logprobs, tail) = head_targets(settings, model, 256, ids)
        assert top_ids.shape == logprobs.shape == (16, base.precompute.top_k) and tail.shape == (16,)
    assert ran == {"slab": "slab", "tiled": "slab"}


@pytest.mark.parametrize("targets", ["sampled", "hybrid"])
def test_a_candidate_of_sampled_targets_times_the_sampler(make_config: Callable[..., Any], targets: str) -> None:
    """The pass of sampled or hybrid targets runs the sampler, not the top-K step (3x slower on this CPU than the
    top-K that tune timed for them): its chunk is the sampler's, a third of the top-K's in the same budget."""
    from kdflow.tasks.teacher.sampled_pass import sampled_chunk_tokens
    from kdflow.tasks.teacher.topk import choose_chunk_tokens

    config = prepare(make_config(dataset__max_documents=12, precompute__chunk_memory_mib=1,
                                 precompute__targets=targets, precompute__sampling__head=4,
                                 precompute__sampling__samples=6))
    record = measure_candidate(open_run_root(config), teacher_pass_settings(config), micro_batch=3, batches=2)
    vocab = record["vocab"]
    assert record["status"] == "ok" and record["tokens_per_s"] > 0
    chunk = sampled_chunk_tokens(config.precompute, vocab)
    assert record["chunk_tokens"] == chunk < choose_chunk_tokens(vocab, 1 << 20)


@pytest.mark.usefixtures("children")
def test_tune_runs_each_candidate_in_its_own_process_and_writes_the_recommendation(
        make_config: Callable[..., Any], tmp_path: Path) -> None:
    """Two candidates fail by injected faults (a driver error, an out-of-memory), one is then skipped; the
    recommendation goes into the YAML file with its comments kept."""
    path = config_yaml(make_config(teacher__device="auto"), tmp_path / "c.yaml")
    before = path.read_text(encoding="utf-8")
    env = os.environ | {"KDFLOW_FAULT": "cuda_error@micro_batch_size=1;cuda_oom@micro_batch_size=4"}
    result = subprocess.run([sys.executable, "-m", "kdflow", "tune", "precompute", str(path), "--micro-batches",
                             "1,2,4,8",
                             "--batches", "1", "--write", "--json"], capture_output=True, text=True, timeout=600,
                            cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    statuses = {c["micro_batch"]: (c["status"], c["exit_code"]) for c in summary["candidates"]}
    assert statuses == {1: ("failed", 71), 2: ("ok", 0), 4: ("out of memory", 75), 8: ("skipped", None)}
    pids = {c["micro_batch"]: c.get("pid") for c in summary["candidates"]}
    assert summary["recommended_micro_batch"] == 2 and pids[2] is not None
    heads = summary["heads"]  # both heads timed at the recommendation, the tiled one against the slab loop
    assert heads["status"] == "ok" and heads["micro_batch"] == 2
    assert [(r["head"], r["runs"]) for r in heads["heads"]] == [("slab", "slab"), ("tiled", "tiled"),
                                                               ("tiled-gemm", "tiled")]  # not timed on a CPU
    assert heads["heads"][1]["correct"] and heads["heads"][1]["max_logprob_diff"] <= 1e-3
    chosen = heads["recommended_head"]
    assert chosen == max(heads["heads"][:2], key=lambda r: r["tokens_per_s"])["head"]
    written = before.replace("micro_batch: 4   # tuned", "micro_batch: 2   # tuned")
    assert path.read_text(encoding="utf-8") == written.replace("  head: slab\n", f"  head: {chosen}\n")
    assert f"recommended: precompute.head: {chosen} (the config has slab)" in result.stdout
    assert "rows: no token shards yet: Python's documentation in rows of 32 tokens" in result.stdout
    assert "<- recommended" in result.stdout
    assert " on cpu (auto), seq_len 32," in result.stdout.splitlines()[0]  # the device `auto` resolved to
    assert "experts" not in summary and "experts" not in result.stdout  # a dense teacher has none to time


@pytest.mark.usefixtures("children")
def test_a_moe_teachers_experts_are_timed_at_the_recommendation_and_the_fastest_correct_written(
        tiny_moe_teacher_dir: Path, corpus_file: Path, tmp_path: Path) -> None:
    from support.tiny import tiny_config

    from kdflow.schemas.config_io import load_config
    from kdflow.tasks.teacher.body_variants import EXPERTS, EXPERTS_TOLERANCE

    path = tmp_path / "moe.yaml"
    path.write_text("# my teacher\n" + dump_config(tiny_config(tmp_path / "run", tiny_moe_teacher_dir, corpus_file,
                                                              teacher__dtype="float32")))
    result = subprocess.run([sys.executable, "-m", "kdflow", "tune", "precompute", str(path), "--micro-batches", "2",
                             "--batches", "1", "--write", "--json"], capture_output=True, text=True, timeout=600,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])["experts"]
    assert outcome["status"] == "ok" and outcome["micro_batch"] == 2
    runs = {r["variant"]: r for r in outcome["experts"]}
    assert sorted(runs) == sorted(EXPERTS) and runs["eager"]["max_rel_diff"] == 0.0
    correct = [r for r in runs.values() if r.get("max_rel_diff", 1.0) <= EXPERTS_TOLERANCE]
    chosen = outcome["recommended_experts"]
    assert chosen == max(correct, key=lambda r: r["tokens_per_s"])["variant"]
    config = load_config(path)
    assert (config.precompute.micro_batch, config.precompute.experts) == (2, chosen)
    assert path.read_text().startswith("# my teacher\n")
    assert f"recommended: precompute.experts: {chosen} (the config has auto)" in result.stdout
    assert config.precompute.head == json.loads(result.stdout.strip().splitlines()[-1])["heads"]["recommended_head"]


def test_the_flow_runs_candidates_as_task_runs(prefect_harness: Any, make_config: Callable[..., Any]) -> None:
    from kdflow.flows.tune_precompute import tune_precompute_flow

    result = tune_precompute_flow(make_config().model_dump(mode="json"), micro_batches="2,3", batches=1)
    assert [c["status"] for c in result["candidates"]] == ["ok", "ok"]
    assert result["recommended_micro_batch"] in (2, 3) and result["recommended_over_fastest"] == 1.0
    assert result["heads"]["status"] == "ok" and result["heads"]["recommended_head"] in ("slab", "tiled")
    assert "experts" not in result  # a dense teacher
