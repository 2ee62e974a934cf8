"""`kdflow validate`: catches changed, truncated, misaligned and malformed shards; `--fix` makes the next run
redo them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.corpus import TINY_VOCAB, flip_byte

from kdflow.cli import main as cli_main
from kdflow.commands.validate import validate_run_root
from kdflow.schemas.commits import (CommitRecord, StageComplete, list_commits, read_complete, stage_dir, write_commit,
                                    write_complete)
from kdflow.schemas.layout import TOKENS_DIR, commit_file_name, data_file_name
from kdflow.schemas.shards import topk_batch, topk_shard_writer
from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.tokenise import tokenise
from kdflow.tasks.validate_checks import topk_problems

TAG, TOP_K = "abcdef012345", 8
Corruption = Callable[[np.ndarray, np.ndarray], None]


def reference_topk(rng: np.random.Generator, rows: int, seq_len: int, vocab: int, top_k: int,
                   dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A valid top-K from random logits: full-vocabulary log-softmax, the K largest, sorted descending."""
    logits = rng.normal(scale=3.0, size=(rows, seq_len, vocab))  # (rows, T, V)
    peak = logits.max(-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits - peak).sum(-1, keepdims=True)) - peak
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[..., :top_k]  # (rows, T, K)
    return ids.astype(np.int32), np.take_along_axis(logprobs, ids, -1).astype(dtype)


def write_topk_store(config: Any, corrupt: dict[int, Corruption] | None = None,
                     vocab_size: int | None = TINY_VOCAB) -> str:
    """A top-K store aligned with the token store, written with the schema writers; `corrupt[i]` edits shard i first."""
    run_root = RunRoot(config.run_root)
    tokens_store = stage_dir(run_root, "tokens")
    tokens_done = read_complete(run_root, tokens_store)
    token_records = list_commits(run_root, tokens_store, "tokens", tokens_done.fingerprint)
    store = stage_dir(run_root, "topk", TAG)
    rng = np.random.default_rng(0)
    for shard_id, token_record in sorted(token_records.items()):
        ids, logprobs = reference_topk(rng, token_record.rows, config.seq_len, TINY_VOCAB, TOP_K, "float16")
        if corrupt and shard_id in corrupt:
            corrupt[shard_id](ids, logprobs)
        name = data_file_name("topk", shard_id)
        with topk_shard_writer(run_root, f"{store}/{name}", config.seq_len, TOP_K, "float16") as writer:
            writer.write(*topk_batch(ids, logprobs, "float16"))
        extra = {"tokens_fingerprint": tokens_done.fingerprint, "top_k": TOP_K, "seq_len": config.seq_len}
        write_commit(run_root, store, CommitRecord(
            stage="topk", shard_id=shard_id, data_file=name, rows=token_record.rows, tokens=token_record.tokens,
            bytes=writer.sink.nbytes, sha256=writer.sink.sha256, input_sha256=token_record.sha256, fingerprint=TAG,
            extra=extra | ({"vocab_size": vocab_size} if vocab_size else {})))
    write_complete(run_root, store, StageComplete(stage="topk", shards=len(token_records), rows=tokens_done.rows,
                                                  tokens=tokens_done.tokens, fingerprint=TAG))
    return store


@pytest.fixture
def tokenised_run(make_config: Callable[..., Any]) -> tuple[Any, Any]:
    """A small run root with corpus and tokens stores: -> (config, tokenizer)."""
    config = make_config(dataset__max_documents=16)
    materialise(open_run_root(config), materialise_settings(config))
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    assert tokenise(open_run_root(config), tokenise_settings(config), tokenizer).shards >= 4
    return config, tokenizer


def run_validate(capsys: pytest.CaptureFixture[str], url: str, fix: bool = False) -> tuple[int, str]:
    code = validate_run_root(url, fix=fix)
    return code, capsys.readouterr().out


def test_clean_run_root_passes(tokenised_run: tuple[Any, Any], capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = tokenised_run
    write_topk_store(config)
    code, out = run_validate(capsys, config.run_root)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[-1].startswith("validate: OK, 3 stores")
    assert [line.split()[0] for line in lines[1:4]] == ["corpus", "tokens", f"topk/{TAG}"]
    assert all(line.rstrip().endswith("ok") for line in lines[1:4]) and "PROBLEM" not in out
    # A pass stopped before its end: what it holds checks out, against the token store's shard count.
    run_root = RunRoot(config.run_root)
    shards = len(list_commits(run_root, stage_dir(run_root, "tokens"), "tokens"))
    store = stage_dir(run_root, "topk", TAG)
    for name in ("_complete.json", commit_file_name("topk", shards - 1)):
        run_root.remove(f"{store}/{name}")
    code, out = run_validate(capsys, config.run_root)
    [line] = [line for line in out.splitlines() if line.startswith(f"topk/{TAG}")]
    assert code == 0 and f" {shards - 1}/{shards} " in line and line.rstrip().endswith("unfinished"), out


def test_changed_token_shard_is_found_fixed_and_recomputed(tokenised_run: tuple[Any, Any],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    config, tokenizer = tokenised_run
    write_topk_store(config)
    run_root = RunRoot(config.run_root)
    store = run_root.path(TOKENS_DIR)
    shard = f"{store}/{data_file_name('tokens', 2)}"
    original = sha256_of(run_root, shard)
    flip_byte(shard)  # same size: only re-hashing can see it

    code, out = run_validate(capsys, config.run_root)
    assert code == 1
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1 and "tokens shard 2: shard-00002.arrow has sha256" in problems[0]
    assert f"delete {store}/{commit_file_name('tokens', 2)}" in problems[0]
    assert os.path.exists(f"{store}/{commit_file_name('tokens', 2)}")  # without --fix, nothing is written

    assert cli_main(["validate", config.run_root, "--fix"]) == 1
    assert "; removed " in capsys.readouterr().out
    assert not os.path.exists(f"{store}/{commit_file_name('tokens', 2)}")
    code, out = run_validate(capsys, config.run_root)  # what will be recomputed, as notes: not an error
    assert code == 0 and "PROBLEM" not in out, out
    assert "tokens" in out
    assert "shard(s) 2 have no commit record: the next run of tokenise computes what is missing" in out
    assert f"topk/{TAG}" in out and "shard(s) 2: their token shards are not committed yet" in out

    summary = tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    assert summary.shards_written == summary.shards - 2  # from the removed shard on
    assert sha256_of(run_root, shard) == original
    code, out = run_validate(capsys, config.run_root)
    assert code == 0, out  # the recomputed shard is identical, so the top-K store is still aligned with it


def test_truncated_shard_is_caught_by_its_size(tokenised_run: tuple[Any, Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    config, tokenizer = tokenised_run
    run_root = RunRoot(config.run_root)
    shard = run_root.path(TOKENS_DIR, data_file_name("tokens", 1))
    size = os.path.getsize(shard)
    os.truncate(shard, size - 7)
    code, out = run_validate(capsys, config.run_root, fix=True)
    assert code == 1
    assert f"tokens shard 1: invalid commit record: data file has {size - 7} bytes, its record says {size}" in out
    assert tokenise(open_run_root(config), tokenise_settings(config), tokenizer).shards_written > 0
    assert run_validate(capsys, config.run_root)[0] == 0


def test_changed_corpus_part_is_recomputed_by_materialise(tokenised_run: tuple[Any, Any],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = tokenised_run
    run_root = RunRoot(config.run_root)
    part = run_root.path("corpus", data_file_name("corpus", 0))
    original = sha256_of(run_root, part)
    flip_byte(part, offset=len(Path(part).read_bytes()) // 2)
    code, out = run_validate(capsys, config.run_root, fix=True)
    assert code == 1 and "corpus shard 0: part-00000.parquet has sha256" in out
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 1
    assert sha256_of(run_root, part) == original and run_validate(capsys, config.run_root)[0] == 0


def _swap_first_two(ids: np.ndarray, logprobs: np.ndarray) -> None:
    logprobs[1, 3, [0, 1]] = logprobs[1, 3, [1, 0]]


def _positive(ids: np.ndarray, logprobs: np.ndarray) -> None:
    logprobs[1, 3, 0] = 0.25


def _nan(ids: np.ndarray, logprobs: np.ndarray) -> None:
    logprobs[1, 3, 5] = np.nan


def _duplicate(ids: np.ndarray, logprobs: np.ndarray) -> None:
    ids[1, 3, 4] = ids[1, 3, 2]


def _beyond_vocab(ids: np.ndarray, logprobs: np.ndarray) -> None:
    ids[1, 3, 7] = TINY_VOCAB


def _negative_tail(ids: np.ndarray, logprobs: np.ndarray) -> None:
    logprobs[1, 3, :] = np.log(0.2)  # five of these already sum to 1; eight sum to 1.6


@pytest.mark.parametrize("corruption, message", [
    (_swap_first_two, "log-probs not sorted descending along K"),
    (_positive, "positive log-prob 0.25"),
    (_nan, "non-finite log-prob"),
    (_duplicate, "a top-K id appears twice"),
    (_beyond_vocab, f"top-K id {TINY_VOCAB} >= vocabulary {TINY_VOCAB}"),
    (_negative_tail, "tail mass 1 - sum(exp(log-probs)) = -0.600")  # float16 rounds log(0.2),
])
def test_topk_content_failures(tokenised_run: tuple[Any, Any], capsys: pytest.CaptureFixture[str],
                               corruption: Corruption,
                               message: str) -> None:
    config, _ = tokenised_run
    store = write_topk_store(config, corrupt={1: corruption})
    code, out = run_validate(capsys, config.run_root, fix=True)
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    assert code == 1 and len(problems) == 1, out
    assert f"topk/{TAG} shard 1: {message}" in problems[0] and " at row 1, position 3" in problems[0]
    assert (sorted(list_commits(RunRoot(config.run_root), store, "topk", TAG))
            == [0] + list(range(2, len(_token_ids(config)))))


def _token_ids(config: Any) -> list[int]:
    run_root = RunRoot(config.run_root)
    return sorted(list_commits(run_root, stage_dir(run_root, "tokens"), "tokens"))


def test_topk_misaligned_with_its_token_shard(tokenised_run: tuple[Any, Any],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = tokenised_run
    store = write_topk_store(config)
    run_root = RunRoot(config.run_root)
    path = f"{store}/{commit_file_name('topk', 0)}"
    record = CommitRecord.model_validate_json(run_root.read_bytes(path))
    write_commit(run_root, store, record.model_copy(update={"input_sha256": "0" * 64}))
    code, out = run_validate(capsys, config.run_root)
    assert code == 1 and f"topk/{TAG} shard 0: not aligned with token shard 0" in out


def test_topk_vocabulary_falls_back_to_the_token_store(tokenised_run: tuple[Any, Any],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = tokenised_run
    write_topk_store(config, corrupt={2: _beyond_vocab}, vocab_size=None)
    code, out = run_validate(capsys, config.run_root)
    assert code == 1 and "checked against the token store's vocabulary" in out
    assert f"topk/{TAG} shard 2: top-K id {TINY_VOCAB} >= vocabulary {TINY_VOCAB}" in out


def test_token_ids_beyond_the_vocabulary(tokenised_run: tuple[Any, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """A token shard rewritten with a bad id and a matching record: only the content check can catch it."""
    from kdflow.schemas.shards import read_token_shard, token_batch, token_shard_writer

    config, _ = tokenised_run
    run_root = RunRoot(config.run_root)
    store = run_root.path(TOKENS_DIR)
    record = list_commits(run_root, store, "tokens")[0]
    input_ids = read_token_shard(run_root, f"{store}/{record.data_file}").copy()  # (rows, T)
    input_ids[2, 5] = TINY_VOCAB + 10
    with token_shard_writer(run_root, f"{store}/{record.data_file}", config.seq_len) as writer:
        writer.write(token_batch(input_ids))
    write_commit(run_root, store, record.model_copy(update={"sha256": writer.sink.sha256, "bytes": writer.sink.nbytes}))
    code, out = run_validate(capsys, config.run_root)
    assert code == 1
    assert f"tokens shard 0: token id {TINY_VOCAB + 10} >= vocabulary {TINY_VOCAB} at row 2, position 5" in out


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_valid_topk_passes_even_when_k_covers_the_vocabulary(dtype: str) -> None:
    """Rounding to float16 must not trip the tolerances: full distributions sum to 1 +- rounding."""
    rng = np.random.default_rng(3)
    for scale_vocab in (16, 64):
        ids, logprobs = reference_topk(rng, 4, 32, scale_vocab, scale_vocab, dtype)
        assert topk_problems(ids, logprobs, scale_vocab) == []
    flat_ids, flat = reference_topk(np.random.default_rng(4), 2, 8, 64, 64, dtype)
    flat[...] = np.log(1 / 64)  # a uniform distribution: many ties, still sorted
    assert topk_problems(flat_ids, flat, 64) == []


def test_missing_run_root_and_empty_run_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_validate(capsys, str(tmp_path / "absent"))
    assert code == 1 and "does not exist" in out
    (tmp_path / "empty").mkdir()
    code, out = run_validate(capsys, str(tmp_path / "empty"))
    assert code == 1 and "nothing to validate" in out


def test_older_token_store_without_vocab_size(tokenised_run: tuple[Any, Any],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Stores written before tokenise recorded `vocab_size`: the tokenizer named by config.yaml gives it, if present."""
    from kdflow.schemas.config_io import write_stage_config

    config, _ = tokenised_run
    run_root = RunRoot(config.run_root)
    store = run_root.path(TOKENS_DIR)
    done = read_complete(run_root, store)
    write_complete(run_root, store,
                   done.model_copy(update={"extra": done.extra.model_copy(update={"vocab_size": None})}))
    for record in list_commits(run_root, store, "tokens").values():
        write_commit(run_root, store,
                     record.model_copy(update={"extra": record.extra.model_copy(update={"vocab_size": None})}))
    code, out = run_validate(capsys, config.run_root)
    # no config.yaml: the upper bound is skipped, with a note
    assert code == 0 and "note: vocabulary size unknown" in out
    write_stage_config(run_root, config, store)
    code, out = run_validate(capsys, config.run_root)
    assert code == 0 and "vocabulary size unknown" not in out


def test_unparseable_files_are_findings_not_crashes(tokenised_run: tuple[Any, Any],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = tokenised_run
    store = write_topk_store(config)
    run_root = RunRoot(config.run_root)
    record = CommitRecord.model_validate_json(run_root.read_bytes(f"{store}/{commit_file_name('topk', 1)}"))
    garbage = b"\x00not arrow\x00" * 8  # a record that matches the garbage exactly: only parsing can tell
    sha = run_root.write_bytes_atomic(f"{store}/{record.data_file}", garbage)
    write_commit(run_root, store, record.model_copy(update={"sha256": sha, "bytes": len(garbage)}))
    run_root.write_bytes_atomic(run_root.path("corpus", "_complete.json"), b"{not json")
    code, out = run_validate(capsys, config.run_root)
    assert code == 1
    assert "corpus: corpus/_complete.json: unreadable" in out.replace(run_root.root + "/", "")
    assert f"topk/{TAG} shard 1: " in out and "unreadable Arrow shard" in out


def test_a_relative_run_root_missing_from_here_says_where_it_was_looked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`kdflow status/validate CONFIG` from another folder: the config's relative run_root is read from the working
    directory, as documented; the message says so, and names the folder above the config that holds it."""
    from kdflow.cli import main

    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    config = project / "configs" / "run.yaml"
    example = (Path(__file__).parents[1] / "configs" / "example.yaml").read_text()
    config.write_text(example.replace("run_root: runs/example", "run_root: runs/mine"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["status", str(config)]) == 1
    assert capsys.readouterr().out.strip() == ("run root runs/mine does not exist (nothing run yet); a relative "
                                               f"run_root is read from the working directory ({elsewhere})")
    (project / "runs" / "mine").mkdir(parents=True)
    assert main(["validate", str(config)]) == 1
    assert capsys.readouterr().out.strip() == (f"run root runs/mine does not exist; a relative run_root is read from "
                                               f"the working directory ({elsewhere}): run from {project}, which holds "
                                               f"{project / 'runs' / 'mine'}")
    assert main(["status", "runs/mine"]) == 1  # a run root given as such: no hint
    assert capsys.readouterr().out.strip() == "run root runs/mine does not exist (nothing run yet)"


def test_a_student_stopped_before_its_first_checkpoint_is_listed(tmp_path: Path, capsys) -> None:
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.validate_students import student_reports

    (tmp_path / "students" / "early").mkdir(parents=True)
    (tmp_path / "students" / "early" / "metrics.jsonl").write_text('{"step": 1}\n')
    [report] = student_reports(RunRoot(str(tmp_path)))
    assert (report.name, report.final, report.checkpoints, report.problems) == ("early", False, [], [])
    validate_run_root(str(tmp_path))
    said = capsys.readouterr().out
    assert "students/early       no finished checkpoint       ok" in said and "with whole weights" not in said
