"""Shard schemas: write -> read is exact, types are the documented ones, `datasets` reads the shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from kdflow.schemas.errors import StoreError
from kdflow.schemas.shards import (CORPUS_SCHEMA, INPUT_IDS, TOPK_IDS, TOPK_LOGPROBS, corpus_table, read_corpus_part,
                                   read_stream_table, read_token_shard, read_topk_shard, token_batch,
                                   token_shard_writer, topk_batch, topk_shard_writer, write_corpus_part)
from kdflow.schemas.storage import RunRoot, sha256_of

SEQ_LEN, TOP_K = 16, 4


@pytest.fixture
def run_root(tmp_path: Path) -> RunRoot:
    return RunRoot(str(tmp_path / "run"))


def random_topk(rng: np.random.Generator, rows: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(0, 50_000, size=(rows, SEQ_LEN, TOP_K), dtype=np.int64).astype(np.int32)  # (rows, T, K)
    logprobs = -np.sort(rng.exponential(3.0, size=(rows, SEQ_LEN, TOP_K)), axis=-1).astype(dtype)  # (rows, T, K)
    return ids, logprobs


def test_corpus_part_round_trip(run_root: RunRoot) -> None:
    texts = ["first document", "zweites Dokument", "三つ目の文書", "emoji \N{SNOWMAN} and\nnewlines"]
    path = run_root.path("corpus", "part-00000.parquet")
    writer = write_corpus_part(run_root, path, corpus_table([10, 11, 12, 13], texts))
    assert writer.nbytes == run_root.size(path) and writer.sha256 == sha256_of(run_root, path)
    table = read_corpus_part(run_root, path)
    assert table.schema.remove_metadata().equals(CORPUS_SCHEMA)
    assert table.column("doc_id").to_pylist() == [10, 11, 12, 13]
    assert table.column("text").to_pylist() == texts


def test_corpus_part_rejects_other_schema(run_root: RunRoot) -> None:
    wrong = pa.table({"doc_id": pa.array([1], pa.int32()), "text": ["x"]})
    with pytest.raises(StoreError, match="corpus part schema"):
        write_corpus_part(run_root, run_root.path("corpus", "part-00000.parquet"), wrong)


def test_token_shard_round_trip_in_several_batches(run_root: RunRoot) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 2**31 - 1, size=(rows, SEQ_LEN)).astype(np.int32) for rows in (3, 1, 5)]  # (rows, T)
    path = run_root.path("tokens", "shard-00000.arrow")
    with token_shard_writer(run_root, path, SEQ_LEN) as writer:
        for batch in batches:
            writer.write(token_batch(batch))
    assert writer.rows == 9
    assert writer.sink.nbytes == run_root.size(path) and writer.sink.sha256 == sha256_of(run_root, path)
    table = read_stream_table(run_root, path)
    assert table.schema.field(INPUT_IDS).type == pa.list_(pa.int32(), SEQ_LEN)
    assert table.schema.metadata[b"kdflow.kind"] == b"tokens"
    assert table.schema.metadata[b"kdflow.seq_len"] == str(SEQ_LEN).encode()
    ids = read_token_shard(run_root, path, SEQ_LEN)
    assert ids.dtype == np.int32 and ids.shape == (9, SEQ_LEN)
    np.testing.assert_array_equal(ids, np.concatenate(batches))
    with pytest.raises(StoreError, match="seq_len 16, expected 32"):
        read_token_shard(run_root, path, 32)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_topk_shard_round_trip(run_root: RunRoot, dtype: str) -> None:
    rng = np.random.default_rng(1)
    batches = [random_topk(rng, rows, dtype) for rows in (2, 3)]
    path = run_root.path("topk", "tag", "shard-00000.arrow")
    with topk_shard_writer(run_root, path, SEQ_LEN, TOP_K, dtype) as writer:
        for ids, logprobs in batches:
            writer.write(*topk_batch(ids, logprobs, dtype))
    table = read_stream_table(run_root, path)
    assert table.schema.field(TOPK_IDS).type == pa.list_(pa.list_(pa.int32(), TOP_K), SEQ_LEN)
    value_type = pa.float16() if dtype == "float16" else pa.float32()
    assert table.schema.field(TOPK_LOGPROBS).type == pa.list_(pa.list_(value_type, TOP_K), SEQ_LEN)
    assert table.schema.metadata[b"kdflow.kind"] == b"topk" and table.schema.metadata[b"kdflow.top_k"] == b"4"
    ids, logprobs = read_topk_shard(run_root, path, SEQ_LEN, TOP_K)
    assert ids.shape == logprobs.shape == (5, SEQ_LEN, TOP_K)
    assert ids.dtype == np.int32 and logprobs.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ids, np.concatenate([b[0] for b in batches]))
    np.testing.assert_array_equal(logprobs, np.concatenate([b[1] for b in batches]))
    with pytest.raises(StoreError, match="K=4, expected K=8"):
        read_topk_shard(run_root, path, SEQ_LEN, 8)
    with pytest.raises(StoreError, match="seq_len 16, expected 8"):
        read_topk_shard(run_root, path, 8, TOP_K)


def test_topk_batch_rejects_mismatched_shapes() -> None:
    ids = np.zeros((2, SEQ_LEN, TOP_K), np.int32)
    with pytest.raises(ValueError, match="shape"):
        topk_batch(ids, np.zeros((2, SEQ_LEN, TOP_K + 1), np.float32), "float32")


def test_datasets_reads_token_and_topk_shards(run_root: RunRoot) -> None:
    import datasets

    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 1000, size=(4, SEQ_LEN)).astype(np.int32)  # (rows, T)
    token_path = run_root.path("tokens", "shard-00000.arrow")
    with token_shard_writer(run_root, token_path, SEQ_LEN) as writer:
        writer.write(token_batch(tokens))
    ids, logprobs = random_topk(rng, 4, "float16")
    topk_path = run_root.path("topk", "tag", "shard-00000.arrow")
    with topk_shard_writer(run_root, topk_path, SEQ_LEN, TOP_K, "float16") as writer:
        writer.write(*topk_batch(ids, logprobs, "float16"))

    token_set = datasets.Dataset.from_file(token_path).with_format("numpy")
    assert len(token_set) == 4
    np.testing.assert_array_equal(np.stack(list(token_set[INPUT_IDS])), tokens)
    topk_set = datasets.Dataset.from_file(topk_path).with_format("numpy")
    row = topk_set[3]
    np.testing.assert_array_equal(np.stack(list(row[TOPK_IDS])), ids[3])
    np.testing.assert_array_equal(np.stack(list(row[TOPK_LOGPROBS])).astype(np.float16), logprobs[3])


def test_unreadable_and_metadata_free_shards(run_root: RunRoot, tmp_path: Path) -> None:
    garbage = run_root.path("tokens", "shard-00001.arrow")
    run_root.write_bytes_atomic(garbage, b"not an arrow stream at all")
    with pytest.raises(StoreError, match="unreadable Arrow shard"):
        read_token_shard(run_root, garbage)
    plain = run_root.path("tokens", "shard-00002.arrow")
    schema = pa.schema([pa.field(INPUT_IDS, pa.list_(pa.int32(), SEQ_LEN))])  # no kdflow metadata
    with run_root.atomic_writer(plain) as sink, ipc.new_stream(sink, schema) as stream:
        stream.write_batch(pa.record_batch([token_batch(np.zeros((1, SEQ_LEN), np.int32))], schema=schema))
    with pytest.raises(StoreError, match="no kdflow.seq_len"):
        read_token_shard(run_root, plain)
