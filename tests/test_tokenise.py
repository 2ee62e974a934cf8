"""Tokenise: packing is exact against a separately written reference; reruns skip; resumes are byte-identical."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.corpus import sample_documents

import kdflow.tasks.corpus.tokenise as tokenise_module
from kdflow.schemas.commits import list_commits, read_complete
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import CORPUS_DIR, TOKENS_DIR, commit_file_name, data_file_name
from kdflow.schemas.shards import read_token_shard
from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.tokenise import tokenise

SEQ_LEN, PER_SHARD = 32, 8


def reference_rows(tokenizer: Any, documents: list[str], seq_len: int) -> tuple[np.ndarray, int]:
    """Every document's tokens followed by one EOS, concatenated, cut into rows: -> (rows, seq_len), dropped tail."""
    stream: list[int] = []
    for text in documents:
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
        stream.append(tokenizer.eos_token_id)
    rows = len(stream) // seq_len
    return np.array(stream[:rows * seq_len], dtype=np.int32).reshape(rows, seq_len), len(stream) - rows * seq_len


def token_store(config: Any) -> tuple[RunRoot, str]:
    run_root = RunRoot(config.run_root)
    return run_root, run_root.path(TOKENS_DIR)


def all_rows(config: Any) -> np.ndarray:
    run_root, store = token_store(config)
    records = list_commits(run_root, store, "tokens")
    assert sorted(records) == list(range(len(records)))
    return np.concatenate([read_token_shard(run_root, f"{store}/{records[i].data_file}", SEQ_LEN)
                           for i in sorted(records)])


def shard_hashes(config: Any) -> dict[str, str]:
    run_root, store = token_store(config)
    return {name: sha256_of(run_root, f"{store}/{name}") for name in run_root.listdir(store) if name.endswith(".arrow")}


@pytest.fixture
def tokenised(make_config: Callable[..., Any]) -> Callable[..., tuple[Any, Any, Any]]:
    """-> build(**overrides): a materialised config, its tokenizer, and the first tokenise summary."""
    def build(**overrides: Any) -> tuple[Any, Any, Any]:
        config = make_config(**overrides)
        materialise(open_run_root(config), materialise_settings(config))
        tokenizer = load_tokenizer(config.teacher, config.tokenizer)
        return config, tokenizer, tokenise(open_run_root(config), tokenise_settings(config), tokenizer)

    return build


@pytest.mark.parametrize(("docs_per_batch", "smallest"), [(1024, 64), (7, 64), (16, 2)])
def test_packing_is_exact(tokenised: Callable[..., tuple[Any, Any, Any]], monkeypatch: pytest.MonkeyPatch,
                          docs_per_batch: int, smallest: int) -> None:
    monkeypatch.setattr(tokenise_module, "DOCS_PER_BATCH", docs_per_batch)  # documents also cross batch boundaries
    monkeypatch.setattr(tokenise_module, "SMALLEST_BATCH", smallest)  # (16, 2): the last documents in halving batches
    config, tokenizer, summary = tokenised()
    expected, dropped = reference_rows(tokenizer, sample_documents(60), SEQ_LEN)
    lengths = [len(tokenizer.encode(d, add_special_tokens=False)) for d in sample_documents(60)]
    assert max(lengths) > 2 * SEQ_LEN  # some documents continue over several rows
    np.testing.assert_array_equal(all_rows(config), expected)
    assert (summary.sequences, summary.dropped_tokens) == (len(expected), dropped) and 0 < dropped < SEQ_LEN
    assert summary.shards == -(-len(expected) // PER_SHARD) and summary.shards_written == summary.shards
    run_root, store = token_store(config)
    records = list_commits(run_root, store, "tokens", summary.fingerprint)
    last_rows = len(expected) - PER_SHARD * (summary.shards - 1)
    assert [records[i].rows for i in sorted(records)] == [PER_SHARD] * (summary.shards - 1) + [last_rows]
    for record in records.values():
        assert record.tokens == record.rows * SEQ_LEN
        assert record.extra.tokenizer_fingerprint == summary.tokenizer_fingerprint
    done = read_complete(run_root, store)
    assert (done.shards, done.rows, done.extra.dropped_tokens) == (summary.shards, len(expected), dropped)
    assert (done.extra.seq_len, done.extra.vocab_size) == (SEQ_LEN, len(tokenizer))


def test_batch_sizes_cover_the_documents_and_halve_at_the_end_of_the_corpus() -> None:
    sizes = list(tokenise_module.batch_sizes(5000, last=True))
    assert sum(sizes) == 5000 and sizes[:3] == [1024] * 3 and sizes[-1] <= 64
    assert all(later <= earlier for earlier, later in zip(sizes, sizes[1:]))  # 1024 x3, then 964, 482, 241, ...
    assert list(tokenise_module.batch_sizes(5000, last=False)) == [1024] * 4 + [904]
    assert list(tokenise_module.batch_sizes(0, last=True)) == []


def test_reader_thread_stops_when_closed_before_any_batch_is_taken() -> None:
    class Encoder:
        def encode(self, texts: list[str]) -> list[str]:
            return texts

    batches = tokenise_module.EncodedBatches(iter([["a"]] * 100), Encoder(), depth=1)  # type: ignore[arg-type]
    batches.close()  # the thread was blocked on a full queue: it must see the stop and end
    assert not batches._thread.is_alive()
    with tokenise_module.EncodedBatches(iter([["a"], ["b"]]), Encoder()) as both:  # type: ignore[arg-type]
        assert list(both) == [["a"], ["b"]]


def test_rerun_does_no_work(tokenised: Callable[..., tuple[Any, Any, Any]]) -> None:
    config, tokenizer, first = tokenised()
    run_root, store = token_store(config)
    before = {name: os.stat(f"{store}/{name}").st_mtime_ns for name in run_root.listdir(store)}
    hashes = shard_hashes(config)
    again = tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    assert again.shards_written == 0
    assert ((again.shards, again.sequences, again.dropped_tokens, again.fingerprint)
            == (first.shards, first.sequences, first.dropped_tokens, first.fingerprint))
    assert {name: os.stat(f"{store}/{name}").st_mtime_ns for name in run_root.listdir(store)} == before
    assert shard_hashes(config) == hashes


@pytest.mark.parametrize("which", ["last", "middle", "first"])
def test_lost_commit_record_is_recomputed_identically(tokenised: Callable[..., tuple[Any, Any, Any]],
                                                      which: str) -> None:
    config, tokenizer, first = tokenised()
    run_root, store = token_store(config)
    hashes = shard_hashes(config)
    shard = {"last": first.shards - 1, "middle": first.shards // 2, "first": 0}[which]
    os.remove(f"{store}/{commit_file_name('tokens', shard)}")  # the data file stays, but is no longer trusted
    assert shard not in list_commits(run_root, store, "tokens", first.fingerprint)
    again = tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    # A sequential stage resumes after the committed prefix: it rewrites the lost shard and the ones after it.
    assert again.shards_written == first.shards - shard
    assert sorted(list_commits(run_root, store, "tokens", first.fingerprint)) == list(range(first.shards))
    assert shard_hashes(config) == hashes
    assert (again.sequences, again.dropped_tokens) == (first.sequences, first.dropped_tokens)


def test_truncated_shard_is_recomputed(tokenised: Callable[..., tuple[Any, Any, Any]]) -> None:
    config, tokenizer, first = tokenised()
    run_root, store = token_store(config)
    hashes = shard_hashes(config)
    path = f"{store}/{data_file_name('tokens', 3)}"
    os.truncate(path, os.path.getsize(path) - 10)
    assert 3 not in list_commits(run_root, store, "tokens", first.fingerprint)
    assert tokenise(open_run_root(config), tokenise_settings(config), tokenizer).shards_written == first.shards - 3
    assert shard_hashes(config) == hashes


def test_interrupted_run_resumes_to_identical_shards(make_config: Callable[..., Any], tmp_path: Path) -> None:
    reference = make_config(run_root=str(tmp_path / "reference"))
    interrupted = make_config(run_root=str(tmp_path / "interrupted"))
    materialise(open_run_root(reference), materialise_settings(reference))
    materialise(open_run_root(interrupted), materialise_settings(interrupted))
    tokenizer = load_tokenizer(reference.teacher, reference.tokenizer)
    expected = tokenise(open_run_root(reference), tokenise_settings(reference), tokenizer)

    def stop_at_five(record: Any) -> None:
        if record.shard_id == 5:
            raise KeyboardInterrupt("stopped after shard 5")

    with pytest.raises(KeyboardInterrupt):
        tokenise(open_run_root(interrupted), tokenise_settings(interrupted), tokenizer, on_shard=stop_at_five)
    run_root, store = token_store(interrupted)
    records = list_commits(run_root, store, "tokens")
    assert sorted(records) == list(range(6)) and read_complete(run_root, store) is None
    assert records[5].extra.end_offset > 0  # the resume point lies inside a document
    resumed = tokenise(open_run_root(interrupted), tokenise_settings(interrupted), tokenizer)
    assert resumed.shards_written == expected.shards - 6
    # The rate counts what this run wrote, not the six shards committed before it.
    assert resumed.tokens_written == resumed.tokens - sum(records[i].tokens for i in range(6))
    assert expected.tokens_written == expected.tokens
    assert ((resumed.shards, resumed.sequences, resumed.dropped_tokens)
            == (expected.shards, expected.sequences, expected.dropped_tokens))
    assert shard_hashes(interrupted) == shard_hashes(reference)


def test_tokenise_needs_a_complete_corpus(make_config: Callable[..., Any]) -> None:
    config = make_config()
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    with pytest.raises(StoreError, match="run materialise first"):
        tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    materialise(open_run_root(config), materialise_settings(config))
    run_root = RunRoot(config.run_root)
    os.remove(run_root.path(CORPUS_DIR, commit_file_name("corpus", 1)))
    with pytest.raises(StoreError, match="no valid commit for part 1; run materialise again"):
        tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    # Another corpus config (a different fingerprint) is not this corpus either.
    other = make_config(dataset__max_documents=10)
    with pytest.raises(StoreError, match="run materialise first"):
        tokenise(open_run_root(other), tokenise_settings(other), tokenizer)


def test_a_corpus_shorter_than_one_sequence_is_named_as_such_before_the_teacher_pass(
        make_config: Callable[..., Any]) -> None:
    from kdflow.schemas.stage_settings import held_out_problem

    config = make_config(dataset__max_documents=1, seq_len=512)
    materialise(open_run_root(config), materialise_settings(config))
    summary = tokenise(open_run_root(config), tokenise_settings(config),
                       load_tokenizer(config.teacher, config.tokenizer))
    assert (summary.shards, summary.sequences) == (0, 0)
    assert held_out_problem(0, summary.shards, summary.sequences).startswith(  # not "eval_shards=0 leaves no ..."
        "the token store holds no sequence: the corpus gave fewer tokens than one sequence of seq_len")
    assert held_out_problem(1, 1, 8).startswith("student.eval_shards=1 leaves no training shard: the token store")
    assert held_out_problem(1, 2, 8) is None
    assert held_out_problem(1, 1, 8).endswith(
        "or precompute.sequences_per_shard (more, smaller shards; tokenise again)")
    assert held_out_problem(1, 1, 1).endswith("; with one sequence, a held-out one leaves none to train on")


def test_truncation_set_on_the_rust_tokenizer_does_not_cut_documents(make_config: Callable[..., Any]) -> None:
    """A tokenizer.json may carry truncation; the stage encodes through the Rust tokenizer directly, and must
    still give every document whole, as calling the transformers tokenizer does."""
    config = make_config()
    materialise(open_run_root(config), materialise_settings(config))
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    tokenizer.backend_tokenizer.enable_truncation(max_length=8)
    tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    assert tokenizer.backend_tokenizer.truncation is not None  # the caller's tokenizer is left as it was
    expected, _ = reference_rows(tokenizer, sample_documents(60), SEQ_LEN)
    np.testing.assert_array_equal(all_rows(config), expected)


def test_a_store_rewritten_with_fewer_shards_leaves_none_of_the_old_ones(
        tokenised: Callable[..., tuple[Any, Any, Any]], make_config: Callable[..., Any]) -> None:
    """Smaller parts and shards first, then larger ones over them: the parts and shards beyond the new stores' end
    go (validate passes the finished run), and a rerun of the first settings rebuilds them byte for byte."""
    from kdflow.commands.validate import validate_run_root

    small, tokenizer, first = tokenised(dataset__documents_per_part=2, precompute__sequences_per_shard=2)
    run_root, store = token_store(small)
    corpus = run_root.path(CORPUS_DIR)
    small_parts = sorted(n for n in run_root.listdir(corpus) if n.endswith(".parquet"))
    hashes = shard_hashes(small)
    large = make_config(dataset__documents_per_part=5, precompute__sequences_per_shard=4)
    materialise(open_run_root(large), materialise_settings(large))
    again = tokenise(open_run_root(large), tokenise_settings(large), tokenizer)
    assert first.shards > again.shards > 0
    assert sorted(n for n in run_root.listdir(store) if n.endswith(".arrow")) == [
        data_file_name("tokens", i) for i in range(again.shards)]
    assert sorted(n for n in run_root.listdir(store) if n.endswith(".commit.json")) == [
        commit_file_name("tokens", i) for i in range(again.shards)]
    parts = read_complete(run_root, corpus).shards
    assert len(small_parts) > parts and sorted(n for n in run_root.listdir(corpus) if n.endswith(".parquet")) == [
        data_file_name("corpus", i) for i in range(parts)]
    assert validate_run_root(large.run_root) == 0

    materialise(open_run_root(small), materialise_settings(small))
    assert tokenise(open_run_root(small), tokenise_settings(small), tokenizer).shards == first.shards
    assert shard_hashes(small) == hashes and validate_run_root(small.run_root) == 0
