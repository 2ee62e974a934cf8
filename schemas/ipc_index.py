"""Where each row of an Arrow IPC stream shard lies in its file, so that a reader fetches only the rows it needs.

A shard is an IPC stream: a schema message, record-batch messages, an end-of-stream marker. Each message
is `[0xFFFFFFFF][int32 metadata length][flatbuffer metadata][body]`; the metadata names the body's length
and, for a record batch, the offset and length of every buffer in the body (Arrow's `Message.fbs`,
`Schema.fbs`). Reading those few hundred bytes per batch is enough to know the file offset of any row of
a fixed-width column (nested fixed-size lists of one integer or float type, as every kdflow column is):
row r of batch b sits at `body_b + buffer_offset + (r - first_row_b) * row_bytes`. Readers then fetch rows
with one byte range per row and column (object stores) or gather them from a memory map (local disk),
never the whole shard. Streams with other columns (variable-length, dictionaries, compression) are indexed
per record batch only: readers fetch the record batches that hold the wanted rows.

The stream index costs one read of the file's head plus one per record batch; when a writer recorded its
batch size (`batch_rows`; precompute's micro-batch) and every batch but the last holds that many rows,
the batches between the first and the last are located by arithmetic and checked at the last one, so a
shard is indexed with two reads whatever its length.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

CONTINUATION = 0xFFFFFFFF
HEAD_BYTES = 64 << 10  # first read of a shard: the schema and the first batch's metadata fit in it
HEADER_BYTES = 4 << 10  # a later record batch's prefix and metadata (kdflow's are ~300 bytes)
_RECORD_BATCH, _DICTIONARY_BATCH, _SCHEMA = 3, 2, 1  # MessageHeader union tags

ReadAt = Callable[[int, int], bytes]  # (offset, length) -> at most `length` bytes of the file from `offset`


class NotIndexable(ValueError):
    """The file is not an IPC stream this module understands (the caller falls back to a whole read)."""


# --- a minimal flatbuffer reader: just what Message and RecordBatch need -----------------------------------


class _Table:
    """A flatbuffer table at `pos` of `buf` (little endian; vtable found through the table's soffset)."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vtable, self.vtable_size = vtable, struct.unpack_from("<H", buf, vtable)[0]

    def _field(self, index: int) -> int:
        slot = 4 + 2 * index
        return struct.unpack_from("<H", self.buf, self.vtable + slot)[0] if slot < self.vtable_size else 0

    def scalar(self, index: int, fmt: str, default: int = 0) -> int:
        offset = self._field(index)
        return struct.unpack_from(fmt, self.buf, self.pos + offset)[0] if offset else default

    def _target(self, index: int) -> int | None:
        offset = self._field(index)
        if not offset:
            return None
        at = self.pos + offset
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, index: int) -> _Table | None:
        target = self._target(index)
        return None if target is None else _Table(self.buf, target)

    def structs(self, index: int, fmt: str) -> list[tuple[int, ...]]:
        """A vector of structs of `fmt` (e.g. two int64s)."""
        target = self._target(index)
        if target is None:
            return []
        count, size = struct.unpack_from("<I", self.buf, target)[0], struct.calcsize(fmt)
        return [struct.unpack_from(fmt, self.buf, target + 4 + i * size) for i in range(count)]


@dataclass(frozen=True)
class _Message:
    kind: int  # MessageHeader tag: 1 schema, 2 dictionary batch, 3 record batch, 0 end of stream
    prefix: int  # bytes before the metadata (8; 4 in the pre-1.0 format without the continuation marker)
    metadata_length: int
    body_length: int
    rows: int = 0
    null_counts: tuple[int, ...] = ()
    buffers: tuple[tuple[int, int], ...] = ()  # (offset in the body, length)
    compressed: bool = False

    @property
    def size(self) -> int:
        return self.prefix + self.metadata_length + self.body_length


def _parse_message(data: bytes, at: int = 0) -> _Message | None:
    """The message starting at `data[at]`, or None when `data` does not yet hold its prefix and metadata."""
    if len(data) < at + 4:
        return None
    first = struct.unpack_from("<I", data, at)[0]
    prefix = 8 if first == CONTINUATION else 4
    if len(data) < at + prefix:
        return None
    metadata_length = struct.unpack_from("<i", data, at + prefix - 4)[0]
    if metadata_length == 0:
        return _Message(0, prefix, 0, 0)
    if metadata_length < 0:
        raise NotIndexable(f"negative metadata length {metadata_length}")
    start = at + prefix
    if len(data) < start + metadata_length:
        return None
    flat = bytes(data[start:start + metadata_length])
    message = _Table(flat, struct.unpack_from("<I", flat, 0)[0])
    kind, body_length = message.scalar(1, "<B"), message.scalar(3, "<q")
    if kind != _RECORD_BATCH:
        return _Message(kind, prefix, metadata_length, body_length)
    batch = message.table(2)
    if batch is None:
        raise NotIndexable("record batch message without its header")
    nodes = batch.structs(1, "<qq")
    return _Message(kind, prefix, metadata_length, body_length, rows=batch.scalar(0, "<q"),
                    null_counts=tuple(n[1] for n in nodes), buffers=tuple(batch.structs(2, "<qq")),
                    compressed=batch.table(3) is not None)


# --- the index --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixedColumn:
    """A column whose rows are all `row_bytes` long: fixed-size lists (shape) of one primitive type."""

    name: str
    index: int  # position in the schema
    value_type: pa.DataType  # the primitive leaf
    shape: tuple[int, ...]  # per row, outermost first, e.g. (seq_len, K)
    node: int  # the leaf's position in the batch's field nodes
    buffer: int  # the leaf's data buffer in the batch's buffers
    row_bytes: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.value_type.to_pandas_dtype())


def fixed_columns(schema: pa.Schema) -> dict[str, FixedColumn] | None:
    """Every column's fixed-width layout, or None if any column is not fixed-width (then batches are read whole)."""
    columns, node, buffer = {}, 0, 0
    for index, field in enumerate(schema):
        kind, shape = field.type, []
        while pa.types.is_fixed_size_list(kind):
            shape.append(kind.list_size)
            kind, node, buffer = kind.value_type, node + 1, buffer + 1  # a list level: one node, a validity buffer
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            return None
        width = kind.bit_width // 8
        columns[field.name] = FixedColumn(field.name, index, kind, tuple(shape), node, buffer + 1,
                                          width * int(np.prod(shape, dtype=np.int64)))
        node, buffer = node + 1, buffer + 2  # the leaf: one node, validity and data buffers
    return columns


@dataclass(frozen=True)
class StreamIndex:
    """Record-batch positions of one IPC stream file and, for fixed-width streams, each column's row offsets."""

    schema: pa.Schema
    size: int  # bytes of the file
    first_rows: np.ndarray  # (B + 1,) int64: first row of each batch, then the total
    offsets: np.ndarray  # (B,) int64: file offset of each batch's message
    sizes: np.ndarray  # (B,) int64: bytes of each batch's message
    columns: dict[str, FixedColumn] | None  # None: not fixed-width, rows are read by whole batches
    data_offsets: dict[str, np.ndarray]  # name -> (B,) file offset of row 0 of the batch in that column
    reads: int  # reads the index cost

    @property
    def rows(self) -> int:
        return int(self.first_rows[-1])

    def batch_of(self, rows: np.ndarray) -> np.ndarray:
        """(n,) rows -> (n,) the batch holding each."""
        return np.searchsorted(self.first_rows, rows, side="right") - 1

    def row_offsets(self, name: str, rows: np.ndarray) -> np.ndarray:
        """(n,) rows -> (n,) file offset of each row's bytes in column `name` (fixed-width streams only)."""
        batch = self.batch_of(rows)
        return self.data_offsets[name][batch] + (rows - self.first_rows[batch]) * self.columns[name].row_bytes


def _fixed_ok(columns: dict[str, FixedColumn] | None, message: _Message) -> bool:
    """Can rows be read from this batch by offset arithmetic (no nulls, no compression, buffers long enough)?"""
    if columns is None or message.compressed or any(message.null_counts):
        return False
    return all(message.buffers[c.buffer][1] >= message.rows * c.row_bytes for c in columns.values())


def index_stream(read_at: ReadAt, size: int, *, rows: int | None = None, batch_rows: int | None = None) -> StreamIndex:
    """Index the IPC stream of `size` bytes read through `read_at`.

    `rows` (the committed row count) and `batch_rows` (the rows of every batch but the last, as the writer
    recorded) let the batches between the first and the last be located without reading their metadata.
    """
    head = read_at(0, min(size, HEAD_BYTES))
    reads = 1
    schema_message = _parse_message(head)
    if schema_message is None or schema_message.kind != _SCHEMA:
        raise NotIndexable("the file does not start with an Arrow IPC schema message")
    schema = pa.ipc.read_schema(pa.py_buffer(head[:schema_message.size]))
    columns = fixed_columns(schema)

    def message_at(offset: int) -> _Message:
        nonlocal reads
        data, at = (head, offset) if offset + 8 <= len(head) else (read_at(offset, min(HEADER_BYTES, size - offset)), 0)
        reads += data is not head
        found = _parse_message(data, at)
        if found is None:  # the metadata is longer than what was read: read exactly what its prefix declares
            prefix = 8 if struct.unpack_from("<I", data, at)[0] == CONTINUATION else 4
            needed = prefix + struct.unpack_from("<i", data, at + prefix - 4)[0]
            if len(data) < at + 8 or not 0 < needed <= min(size - offset, 1 << 24):
                raise NotIndexable(f"truncated or corrupt message at byte {offset}")
            found = _parse_message(read_at(offset, needed))
            reads += 1
            if found is None:
                raise NotIndexable(f"truncated message at byte {offset}")
        if found.kind == _DICTIONARY_BATCH:
            raise NotIndexable("dictionary-encoded streams are not indexed")
        if found.kind not in (0, _RECORD_BATCH):
            raise NotIndexable(f"unexpected message type {found.kind} at byte {offset}")
        return found

    batches: list[tuple[int, _Message]] = []
    offset = schema_message.size
    while size - offset > 8:  # what is left past the last batch is at most the end-of-stream marker
        message = message_at(offset)
        if message.kind == 0:  # end of stream
            break
        batches.append((offset, message))
        offset += message.size
        # Only fixed-width batches of equal rows are equal in size: variable-width ones (v2 top-K) are read one by one.
        if (len(batches) == 1 and rows is not None and batch_rows is not None and message.rows == batch_rows < rows
                and _fixed_ok(columns, message)):
            predicted = _predict_uniform(batches[0], rows, message_at, size)
            if predicted is not None:
                batches = predicted
                break
    if offset > size:
        raise NotIndexable(f"the stream runs past the end of the file ({offset} > {size} bytes)")
    if columns is not None and not all(_fixed_ok(columns, m) for _, m in batches):
        columns = None
    first_rows = np.zeros(len(batches) + 1, dtype=np.int64)
    first_rows[1:] = np.cumsum([m.rows for _, m in batches])
    offsets = np.array([o for o, _ in batches], dtype=np.int64)
    data_offsets = {}
    if columns is not None:
        for name, column in columns.items():
            data_offsets[name] = np.array([o + m.prefix + m.metadata_length + m.buffers[column.buffer][0]
                                           for o, m in batches], dtype=np.int64)
    return StreamIndex(schema, size, first_rows, offsets, np.array([m.size for _, m in batches], dtype=np.int64),
                       columns, data_offsets, reads)


def _predict_uniform(first: tuple[int, _Message], rows: int, message_at: Callable[[int], _Message],
                     size: int) -> list[tuple[int, _Message]] | None:
    """Batches 0..B-2 as copies of batch 0 (same rows, same layout), checked by reading batch B-1's metadata:
    it must sit at the predicted offset, hold the remaining rows and end where the stream ends."""
    offset0, message0 = first
    count = -(-rows // message0.rows)
    last_offset = offset0 + (count - 1) * message0.size
    if last_offset + 8 > size:
        return None
    try:
        last = message_at(last_offset)
    except Exception:  # noqa: BLE001 - whatever lies at a wrong guess does not parse: no prediction
        return None
    end = last_offset + last.size
    ends_stream = size - end in (0, 4, 8)  # nothing, or the end-of-stream marker (4 bytes in the pre-1.0 format)
    if last.kind != _RECORD_BATCH or last.rows != rows - (count - 1) * message0.rows or not ends_stream:
        return None
    middle = [(offset0 + i * message0.size, message0) for i in range(count - 1)]
    return [*middle, (last_offset, last)]


# --- rows as record batches -------------------------------------------------------------------------------


def nest(flat: np.ndarray, value_type: pa.DataType, shape: tuple[int, ...]) -> pa.Array:
    """(n, *shape) values -> a nested fixed_size_list array of n rows, without copying."""
    array: pa.Array = pa.array(np.ascontiguousarray(flat).reshape(-1), type=value_type)
    for size in reversed(shape):
        array = pa.FixedSizeListArray.from_arrays(array, size)
    return array


def rows_batch(index: StreamIndex, row_bytes: dict[str, np.ndarray]) -> pa.RecordBatch:
    """Record batch from each fixed-width column's gathered rows, (n, row_bytes) uint8 each."""
    arrays = []
    for field in index.schema:
        column = index.columns[field.name]
        values = row_bytes[field.name].view(column.dtype).reshape(-1, *column.shape)
        arrays.append(nest(values, column.value_type, column.shape))
    return pa.RecordBatch.from_arrays(arrays, schema=index.schema)


def merged_ranges(starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal-length byte ranges -> (range starts, range ends, which range each input falls in), adjacent
    and repeated ranges merged into one read. `starts` (n,) int64."""
    order = np.argsort(starts, kind="stable")
    ordered = starts[order]
    new_range = np.ones(len(ordered), dtype=bool)
    new_range[1:] = ordered[1:] > ordered[:-1] + length  # touching or overlapping: the same read
    group = np.cumsum(new_range) - 1
    range_starts = ordered[new_range]
    range_ends = np.maximum.reduceat(ordered + length, np.flatnonzero(new_range)) if len(ordered) else ordered
    which = np.empty_like(group)
    which[order] = group
    return range_starts, range_ends, which
