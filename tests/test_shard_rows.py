"""Rows of IPC shards by byte range: the stream index agrees with pyarrow's own reading, any set of rows comes
back exact and in order, and the reads stay small (two to index a shard whose batch size is recorded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from kdflow.schemas.errors import StoreError
from kdflow.schemas.ipc_index import index_stream, merged_ranges
from kdflow.schemas.shard_rows import ShardRows, take_rows
from kdflow.schemas.shards import (decode_token_rows, decode_topk_rows, iter_topk_shard, token_batch,
                                   token_shard_writer, topk_batch, topk_shard_writer)
from kdflow.schemas.storage import RunRoot

SEQ_LEN, TOP_K = 64, 64  # rows of 16 KiB (ids) and 8 KiB (float16 log-probs): a batch is larger than the first read


@pytest.fixture
def run_root(tmp_path: Path) -> RunRoot:
    return RunRoot(str(tmp_path / "run"))


def write_topk(run_root: RunRoot, name: str, batch_sizes: list[int],
               seed: int = 0) -> tuple[str, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = sum(batch_sizes)
    ids = rng.integers(0, 196_608, size=(rows, SEQ_LEN, TOP_K)).astype(np.int32)  # (rows, T, K)
    logprobs = -rng.exponential(3.0, size=(rows, SEQ_LEN, TOP_K)).astype(np.float16)  # (rows, T, K)
    path = run_root.path("topk", name)
    with topk_shard_writer(run_root, path, SEQ_LEN, TOP_K, "float16") as writer:
        start = 0
        for size in batch_sizes:
            writer.write(*topk_batch(ids[start:start + size], logprobs[start:start + size], "float16"))
            start += size
    return path, ids, logprobs


def pyarrow_data_offsets(path: str, column: str) -> list[int]:
    """File offset of each record batch's leaf values of `column`, from the buffers pyarrow maps."""
    with pa.memory_map(path) as source:
        base = source.read_buffer(source.size()).address
        source.seek(0)
        return [batch.column(column).values.values.buffers()[1].address - base for batch in ipc.open_stream(source)]


@pytest.mark.parametrize("batch_sizes, batch_rows, reads", [
    ([5, 5, 5, 5, 3], 5, 2),  # precompute's layout, micro-batch recorded: head + last batch
    ([5, 5, 5, 5, 5], 5, 2),  # the last batch full as well
    ([5, 5, 5, 5, 3], None, 5),  # nothing recorded: one read per batch past the head
    ([5, 5, 5, 5, 3], 4, 5),  # a wrong record is noticed: the same scan
    ([3, 1, 5], 3, 4),  # uneven batches: the check at the predicted last batch fails (one read), then scanned
    ([23], 23, 1),  # a token shard's single batch
])
def test_index_agrees_with_pyarrow_and_rows_come_back_exact(run_root: RunRoot, batch_sizes, batch_rows, reads) -> None:
    path, ids, logprobs = write_topk(run_root, "shard-00000.arrow", batch_sizes)
    size = run_root.size(path)
    index = index_stream(lambda offset, length: run_root.read_ranges([path], [offset], [offset + length])[0], size,
                         rows=len(ids), batch_rows=batch_rows)
    assert index.rows == len(ids) and index.reads == reads
    assert list(np.diff(index.first_rows)) == batch_sizes
    for column in ("topk_ids", "topk_logprobs"):
        assert index.data_offsets[column].tolist() == pyarrow_data_offsets(path, column)

    rows = np.array([len(ids) - 1, 0, 7, 7, 3, 4, 5, len(ids) // 2])  # unsorted, a repeat, a run of neighbours
    shard = ShardRows(run_root, path, size, len(ids), batch_rows)
    got_ids, got_logprobs = decode_topk_rows(shard.take(rows), SEQ_LEN, TOP_K)  # memory map
    assert np.array_equal(got_ids, ids[rows]) and np.array_equal(got_logprobs, logprobs[rows])
    plan = shard.plan(rows)  # the object-store path: byte ranges, adjacent and repeated rows in one range
    wanted, batch = set(rows.tolist()), index.batch_of(np.arange(len(ids)))
    # neighbours in one batch: one range
    runs = sum(1 for r in wanted if r - 1 not in wanted or batch[r - 1] != batch[r])
    assert len(plan.starts) == 2 * runs  # per column
    got_ids, got_logprobs = decode_topk_rows(plan.finish(run_root.read_ranges([path] * len(plan.starts), plan.starts,
                                                                                plan.ends)), SEQ_LEN, TOP_K)
    assert np.array_equal(got_ids, ids[rows]) and np.array_equal(got_logprobs, logprobs[rows])


def test_rows_of_several_shards_in_one_call_and_streaming_by_batch(run_root: RunRoot) -> None:
    path_a, ids_a, _ = write_topk(run_root, "shard-00000.arrow", [4, 4, 2], seed=1)
    path_b, ids_b, logprobs_b = write_topk(run_root, "shard-00001.arrow", [4, 1], seed=2)
    shards = [ShardRows(run_root, p, run_root.size(p), n, 4) for p, n in ((path_a, 10), (path_b, 5))]
    first, second = take_rows([(shards[0], np.array([9, 0])), (shards[1], np.array([4]))])
    assert np.array_equal(decode_topk_rows(first, SEQ_LEN, TOP_K)[0], ids_a[[9, 0]])
    assert np.array_equal(decode_topk_rows(second, SEQ_LEN, TOP_K)[0], ids_b[[4]])
    streamed = list(iter_topk_shard(run_root, path_b, SEQ_LEN))
    assert [len(ids) for ids, _ in streamed] == [4, 1]
    assert np.array_equal(np.concatenate([lp for _, lp in streamed]), logprobs_b)


def test_a_memory_map_lives_for_one_call_only(run_root: RunRoot) -> None:
    """Local reads map the shard for the call and unmap it after: resident memory does not grow with the store."""
    path, ids, _ = write_topk(run_root, "shard-00000.arrow", [5, 5])
    shard = ShardRows(run_root, path, run_root.size(path), 10, 5)
    got = decode_topk_rows(shard.take(np.arange(10)), SEQ_LEN, TOP_K)[0]
    assert np.array_equal(got, ids)
    assert path not in Path("/proc/self/maps").read_text()


def test_streams_that_are_not_fixed_width_are_read_by_record_batch(run_root: RunRoot) -> None:
    """A compressed stream, or one with a variable-length column, has no row offsets: whole batches are fetched."""
    input_ids = np.arange(12 * 8, dtype=np.int32).reshape(12, 8)  # (rows, T)
    schema = pa.schema([pa.field("input_ids", pa.list_(pa.int32(), 8)), pa.field("note", pa.string())],
                       metadata={b"kdflow.seq_len": b"8"})
    for name, options in (("shard-00000.arrow", None), ("shard-00001.arrow", ipc.IpcWriteOptions(compression="zstd"))):
        path = run_root.path("tokens", name)
        run_root.makedirs(str(Path(path).parent))
        with pa.OSFile(path, "wb") as sink, ipc.new_stream(sink, schema, options=options) as writer:
            for start in (0, 5, 9):
                rows = input_ids[start:start + [5, 4, 3][[0, 5, 9].index(start)]]
                writer.write_batch(pa.record_batch([token_batch(rows), pa.array([f"r{i}" for i in range(len(rows))])],
                                                   schema=schema))
        shard = ShardRows(run_root, path, run_root.size(path), 12)
        assert shard.index().columns is None
        wanted = np.array([11, 2, 6, 6])
        assert np.array_equal(decode_token_rows(shard.take(wanted), 8), input_ids[wanted])


def test_token_shard_single_batch_and_bad_files(run_root: RunRoot) -> None:
    path = run_root.path("tokens", "shard-00000.arrow")
    input_ids = np.arange(40 * 16, dtype=np.int32).reshape(40, 16)
    with token_shard_writer(run_root, path, 16) as writer:
        writer.write(token_batch(input_ids))
    shard = ShardRows(run_root, path, run_root.size(path), 40)
    assert np.array_equal(decode_token_rows(shard.take(np.array([39, 1])), 16), input_ids[[39, 1]])
    with pytest.raises(StoreError, match="row 40 outside its 40 rows"):
        shard.take(np.array([40]))
    with pytest.raises(StoreError, match="40 rows, its commit record says 41"):
        ShardRows(run_root, path, run_root.size(path), 41).index()
    garbage = run_root.path("tokens", "garbage.arrow")
    run_root.write_bytes_atomic(garbage, b"not arrow at all, just bytes" * 10)
    with pytest.raises(StoreError, match="not an Arrow IPC stream shard"):
        ShardRows(run_root, garbage, run_root.size(garbage)).take(np.array([0]))


def test_merged_ranges_join_touching_and_repeated_rows() -> None:
    starts, ends, which = merged_ranges(np.array([40, 0, 10, 10, 30, 20]), 10)
    assert starts.tolist() == [0] and ends.tolist() == [50] and which.tolist() == [0] * 6
    starts, ends, which = merged_ranges(np.array([100, 0, 5]), 4)
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 4), (5, 9), (100, 104)] and which.tolist() == [2, 0, 1]


def test_variable_width_batches_are_located_one_by_one_even_when_their_sizes_fool_a_prediction(
        run_root: RunRoot) -> None:
    """Binary cells (v2 top-K shards) make record batches of equal rows differ in size. Here the first three sum to
    three times the first, so a prediction from batch 0 finds a valid last batch where it expects it, and would
    misplace the middle ones: such streams must be indexed batch by batch."""
    schema = pa.schema([pa.field("cell", pa.binary(), nullable=False)])
    lengths = [(8, 8), (16, 8), (0, 8), (8, 8)]  # bytes per row, 4 batches of 2 rows: data 16, 24, 8, 16
    cells = [bytes([i]) * n for i, n in enumerate(n for pair in lengths for n in pair)]
    path = run_root.path("topk", "shard-00000.arrow")
    with run_root.atomic_writer(path) as sink, ipc.new_stream(sink, schema) as writer:
        for b in range(4):
            writer.write_batch(pa.record_batch([pa.array(cells[2 * b:2 * b + 2], pa.binary())], schema=schema))
    sizes = index_stream(lambda at, n: run_root.read_ranges([path], [at], [at + n])[0], run_root.size(path)).sizes
    assert sizes[:3].sum() == 3 * sizes[0] and len({*sizes[:3].tolist()}) > 1  # the trap is set
    shard = ShardRows(run_root, path, run_root.size(path), 8, 2)
    rows = np.array([3, 4, 2, 5, 7, 0])
    assert shard.take(rows).column("cell").to_pylist() == [cells[r] for r in rows]
