"""Rows of committed IPC stream shards, read without reading whole shards, as record batches to decode.

`ShardRows` indexes a shard once (kdflow.schemas.ipc_index: two small reads) and then serves any set of its
rows: on local disk gathered from a memory map with one numpy fancy-index per column (the mapping lives
only for the call, so resident memory does not grow with the store); on object stores fetched as byte
ranges, one per run of adjacent rows and column, the ranges of many shards in one concurrent batch
(`take_rows`). Streams that are not fixed-width are served by whole record batches. Either way the caller
gets a record batch of exactly the rows asked for, in that order, and decodes it with one call
(kdflow.schemas.shards `decode_token_rows` / `decode_topk_rows`).

`iter_batches` streams a shard record batch by record batch (validate), through a bounded read cache on
object stores: memory is one record batch, never the whole shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from numpy.lib.stride_tricks import sliding_window_view

from kdflow.schemas.errors import StoreError
from kdflow.schemas.ipc_index import NotIndexable, StreamIndex, index_stream, merged_ranges, rows_batch
from kdflow.schemas.storage import RunRoot

STREAM_BLOCK_BYTES = 8 << 20  # read cache of `iter_batches` on object stores
INDEX_THREADS = 16  # shards indexed at once when a batch first touches many


def _unit(offsets: np.ndarray, row_bytes: int) -> int:
    """The widest element (8, 4, 2 or 1 bytes) that divides every offset and the row length: numpy's fancy
    indexing copies rows of wide elements about as fast as memcpy."""
    for unit in (8, 4, 2):
        if row_bytes % unit == 0 and not (offsets % unit).any():
            return unit
    return 1


def _gather(flat: np.ndarray, starts: np.ndarray, row_bytes: int) -> np.ndarray:
    """(n,) byte offsets into the uint8 buffer `flat` -> (n, row_bytes) uint8 copy of those rows."""
    unit = _unit(starts, row_bytes)
    usable = flat[: len(flat) // unit * unit].view(f"<u{unit}" if unit > 1 else np.uint8)
    windows = sliding_window_view(usable, row_bytes // unit)  # (len - w + 1, w): a view, no copy
    return windows[starts // unit].view(np.uint8).reshape(len(starts), row_bytes)


@dataclass
class RangePlan:
    """Byte ranges of one file to fetch, and what turns their bytes into the record batch of the rows asked for."""

    path: str
    starts: list[int]
    ends: list[int]
    finish: Callable[[list[bytes]], pa.RecordBatch | pa.Table]


class ShardRows:
    """The rows of one committed shard file (`size` bytes, `rows` rows; `batch_rows`: the rows of each record
    batch but the last, when its writer recorded them)."""

    def __init__(self, run_root: RunRoot, path: str, size: int, rows: int | None = None,
                 batch_rows: int | None = None) -> None:
        self.run_root, self.path, self.size, self.rows, self.batch_rows = run_root, path, size, rows, batch_rows
        self._index: StreamIndex | None = None
        self._lock = threading.Lock()

    def index(self) -> StreamIndex:
        with self._lock:
            if self._index is None:
                def read_at(offset: int, length: int) -> bytes:
                    return self.run_root.read_ranges([self.path], [offset], [offset + length])[0]

                try:
                    self._index = index_stream(read_at, self.size, rows=self.rows, batch_rows=self.batch_rows)
                except NotIndexable as error:
                    raise StoreError(f"{self.run_root.display(self.path)}: not an Arrow IPC stream shard: "
                                     f"{error}") from None
                if self.rows is not None and self._index.rows != self.rows:
                    raise StoreError(f"{self.run_root.display(self.path)}: {self._index.rows} rows, "
                                     f"its commit record says {self.rows}")
            return self._index

    def _check(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.index().rows):
            raise StoreError(f"{self.run_root.display(self.path)}: row {int(rows.max())} "
                             f"outside its {self.index().rows} rows")
        return rows

    def take(self, rows: np.ndarray) -> pa.RecordBatch | pa.Table:
        """The given rows (n,), in that order (repeats allowed), as one record batch (or table)."""
        rows = self._check(rows)
        index = self.index()
        if self.run_root.is_local and index.columns is not None:
            return self._take_mapped(index, rows)
        plan = self.plan(rows)
        return plan.finish(self.run_root.read_ranges([plan.path] * len(plan.starts), plan.starts, plan.ends))

    def _take_mapped(self, index: StreamIndex, rows: np.ndarray) -> pa.RecordBatch:
        """Local disk: gather from a memory map that lives for this call only (its pages leave our resident set)."""
        with pa.memory_map(self.path, "r") as source:
            flat = np.frombuffer(source.read_buffer(index.size), dtype=np.uint8)
            gathered = {name: _gather(flat, index.row_offsets(name, rows), column.row_bytes)
                        for name, column in index.columns.items()}
            del flat
        return rows_batch(index, gathered)

    def plan(self, rows: np.ndarray) -> RangePlan:
        """The byte ranges that hold `rows`, and how their bytes become the record batch of those rows."""
        rows = self._check(rows)
        index = self.index()
        if index.columns is None:
            return self._plan_whole_batches(index, rows)
        per_column = []
        starts: list[int] = []
        ends: list[int] = []
        for name, column in index.columns.items():
            offsets = index.row_offsets(name, rows)
            range_starts, range_ends, which = merged_ranges(offsets, column.row_bytes)
            per_column.append((name, column.row_bytes, offsets, range_starts, which, len(starts)))
            starts += range_starts.tolist()
            ends += range_ends.tolist()

        def finish(blobs: list[bytes]) -> pa.RecordBatch:
            gathered = {}
            for name, row_bytes, offsets, range_starts, which, first in per_column:
                mine = blobs[first:first + len(range_starts)]
                positions = np.zeros(len(mine) + 1, dtype=np.int64)
                positions[1:] = np.cumsum([len(b) for b in mine])
                flat = np.frombuffer(b"".join(mine), dtype=np.uint8)
                gathered[name] = _gather(flat, positions[which] + offsets - range_starts[which], row_bytes)
            return rows_batch(index, gathered)

        return RangePlan(self.path, starts, ends, finish)

    def _plan_whole_batches(self, index: StreamIndex, rows: np.ndarray) -> RangePlan:
        batches = np.unique(index.batch_of(rows))  # (m,) sorted

        def finish(blobs: list[bytes]) -> pa.Table:
            decoded = [ipc.read_record_batch(ipc.read_message(pa.py_buffer(blob)), index.schema) for blob in blobs]
            table = pa.Table.from_batches(decoded, schema=index.schema)
            first_of = np.zeros(len(batches) + 1, dtype=np.int64)
            first_of[1:] = np.cumsum(index.first_rows[batches + 1] - index.first_rows[batches])
            slot = np.searchsorted(batches, index.batch_of(rows))
            return table.take(pa.array(first_of[slot] + rows - index.first_rows[batches[slot]]))

        return RangePlan(self.path, index.offsets[batches].tolist(),
                         (index.offsets[batches] + index.sizes[batches]).tolist(), finish)

    def iter_batches(self) -> Iterator[pa.RecordBatch]:
        """The shard's record batches in order; memory one batch (a bounded read cache on object stores)."""
        local = self.run_root.local_path(self.path)
        try:
            if local is not None:
                with pa.memory_map(local, "r") as source:
                    yield from ipc.open_stream(source)
                return
            with self.run_root.open_read(self.path, block_size=STREAM_BLOCK_BYTES, cache_type="readahead") as handle:
                yield from ipc.open_stream(handle)
        except (pa.ArrowInvalid, OSError) as error:
            raise StoreError(f"{self.run_root.display(self.path)}: unreadable Arrow shard: {error}") from None


def index_all(readers: Sequence[ShardRows]) -> None:
    """Index the readers that are not yet indexed, several at a time (object stores: one round trip each)."""
    missing = [reader for reader in readers if reader._index is None]
    if len(missing) <= 1 or missing[0].run_root.is_local:
        for reader in missing:
            reader.index()
        return
    with ThreadPoolExecutor(min(INDEX_THREADS, len(missing))) as pool:
        list(pool.map(ShardRows.index, missing))


def take_rows(requests: Sequence[tuple[ShardRows, np.ndarray]]) -> list[pa.RecordBatch | pa.Table]:
    """`reader.take(rows)` for each request; on object stores the ranges of every request in one concurrent batch."""
    if not requests:
        return []
    run_root = requests[0][0].run_root
    index_all([reader for reader, _ in requests])
    if run_root.is_local:
        return [reader.take(rows) for reader, rows in requests]
    plans = [reader.plan(rows) for reader, rows in requests]
    paths = [plan.path for plan in plans for _ in plan.starts]
    blobs = run_root.read_ranges(paths, [s for plan in plans for s in plan.starts],
                                 [e for plan in plans for e in plan.ends])
    out, first = [], 0
    for plan in plans:
        out.append(plan.finish(blobs[first:first + len(plan.starts)]))
        first += len(plan.starts)
    return out
