"""Arrow schemas of the corpus, token and top-K shards, and the only code that writes or reads them.

Column names and types are defined here and nowhere else (docs/formats.md):
- corpus part  (Parquet):          doc_id int64, text string
- token shard  (Arrow IPC stream): input_ids  fixed_size_list<int32>[seq_len]
- top-K shard v1 (Arrow IPC stream): topk_ids   fixed_size_list<fixed_size_list<int32>[K]>[seq_len]
                                      topk_logprobs  same shape, float16 (default) or float32
- top-K shard v2 (Arrow IPC stream): one record per row of binary columns, coded by `kdflow.schemas.codec`
                                      (layout in its docstring; metadata kdflow.format = 2)
Top-K row r, position t is the teacher's distribution for the token after position t of token row r,
as log-probabilities normalised over the full vocabulary, sorted descending along K; v2 also stores the
exact log of the mass outside the stored ids (`tail_logprob`). `TopkShard` reads both formats.
IPC *stream* format, uncompressed: memory-mappable and readable by `datasets.Dataset.from_file`.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from kdflow.schemas.codec import DecodedTopk, TopkCodec, decode, from_v1
from kdflow.schemas.codec_meta import META_FORMAT
from kdflow.schemas.errors import StoreError
from kdflow.schemas.storage import HashingWriter, RunRoot

DOC_ID, TEXT = "doc_id", "text"
INPUT_IDS = "input_ids"
TOPK_IDS, TOPK_LOGPROBS = "topk_ids", "topk_logprobs"

CORPUS_SCHEMA = pa.schema([pa.field(DOC_ID, pa.int64(), nullable=False), pa.field(TEXT, pa.string(), nullable=False)])
LOGPROB_TYPES = {"float16": pa.float16(), "float32": pa.float32()}


def token_schema(seq_len: int) -> pa.Schema:
    return pa.schema(
        [pa.field(INPUT_IDS, pa.list_(pa.int32(), seq_len), nullable=False)],
        metadata={b"kdflow.kind": b"tokens", b"kdflow.seq_len": str(seq_len).encode()},
    )


def topk_schema(seq_len: int, top_k: int, logprobs_dtype: str = "float16") -> pa.Schema:
    value_type = LOGPROB_TYPES[logprobs_dtype]
    return pa.schema(
        [
            pa.field(TOPK_IDS, pa.list_(pa.list_(pa.int32(), top_k), seq_len), nullable=False),
            pa.field(TOPK_LOGPROBS, pa.list_(pa.list_(value_type, top_k), seq_len), nullable=False),
        ],
        metadata={
            b"kdflow.kind": b"topk",
            b"kdflow.seq_len": str(seq_len).encode(),
            b"kdflow.top_k": str(top_k).encode(),
        },
    )


# --- corpus parts -----------------------------------------------------------------------------------------


def corpus_table(doc_ids: Sequence[int], texts: Sequence[str]) -> pa.Table:
    return pa.table({DOC_ID: pa.array(doc_ids, pa.int64()), TEXT: pa.array(texts, pa.string())}, schema=CORPUS_SCHEMA)


def write_corpus_part(run_root: RunRoot, path: str, table: pa.Table) -> HashingWriter:
    if not table.schema.equals(CORPUS_SCHEMA):
        raise StoreError(f"corpus part schema {table.schema} is not {CORPUS_SCHEMA}")
    with run_root.atomic_writer(path) as writer:
        pq.write_table(table, writer, compression="zstd")
    return writer


def read_corpus_part(run_root: RunRoot, path: str) -> pa.Table:
    with run_root.open_read(path) as handle:
        table = pq.read_table(handle)
    if not table.schema.remove_metadata().equals(CORPUS_SCHEMA):
        raise StoreError(f"{path}: not a corpus part (schema {table.schema.names})")
    return table


# --- fixed-size nested lists <-> numpy without copies -----------------------------------------------------


def _nest(flat: np.ndarray, *sizes: int) -> pa.Array:
    """(rows, *sizes) numpy -> nested fixed_size_list array, innermost size last."""
    array: pa.Array = pa.array(flat.reshape(-1))
    for size in reversed(sizes):
        array = pa.FixedSizeListArray.from_arrays(array, size)
    return array


def _unnest(column: pa.ChunkedArray | pa.Array, *sizes: int) -> np.ndarray:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    for _ in sizes:
        array = array.flatten() if array.offset else array.values
    return array.to_numpy(zero_copy_only=False).reshape(-1, *sizes)


# --- Arrow IPC stream shards ------------------------------------------------------------------------------


class StreamShardWriter:
    """Writes one shard as an IPC stream, batch by batch, atomically (see RunRoot.atomic_writer)."""

    def __init__(self, run_root: RunRoot, path: str, schema: pa.Schema) -> None:
        self._context = run_root.atomic_writer(path)
        self.schema = schema
        self.rows = 0
        self.sink: HashingWriter | None = None
        self._ipc: ipc.RecordBatchStreamWriter | None = None

    def __enter__(self) -> StreamShardWriter:
        self.sink = self._context.__enter__()
        self._ipc = ipc.new_stream(self.sink, self.schema)
        return self

    def write(self, *columns: pa.Array) -> None:
        self.write_batch(pa.record_batch(list(columns), schema=self.schema))

    def write_batch(self, batch: pa.RecordBatch) -> None:
        self._ipc.write_batch(batch)
        self.rows += batch.num_rows

    def __exit__(self, exc_type, exc, tb) -> bool | None:
        if exc_type is None:
            self._ipc.close()
        return self._context.__exit__(exc_type, exc, tb)


def token_shard_writer(run_root: RunRoot, path: str, seq_len: int) -> StreamShardWriter:
    return StreamShardWriter(run_root, path, token_schema(seq_len))


def token_batch(input_ids: np.ndarray) -> pa.Array:
    """(rows, seq_len) integer array -> the input_ids column."""
    rows, seq_len = input_ids.shape
    return _nest(np.ascontiguousarray(input_ids, dtype=np.int32), seq_len)


def topk_shard_writer(run_root: RunRoot, path: str, seq_len: int, top_k: int, logprobs_dtype: str) -> StreamShardWriter:
    return StreamShardWriter(run_root, path, topk_schema(seq_len, top_k, logprobs_dtype))


def topk_batch(topk_ids: np.ndarray, topk_logprobs: np.ndarray, logprobs_dtype: str) -> tuple[pa.Array, pa.Array]:
    """(rows, seq_len, K) ids and log-probs -> the two top-K columns."""
    rows, seq_len, top_k = topk_ids.shape
    if topk_logprobs.shape != topk_ids.shape:
        raise ValueError(f"topk_logprobs shape {topk_logprobs.shape} differs from topk_ids shape {topk_ids.shape}")
    ids = _nest(np.ascontiguousarray(topk_ids, dtype=np.int32), seq_len, top_k)
    logprobs = _nest(np.ascontiguousarray(topk_logprobs, dtype=np.dtype(logprobs_dtype)), seq_len, top_k)
    return ids, logprobs


def topk_v2_shard_writer(run_root: RunRoot, path: str, codec: TopkCodec) -> StreamShardWriter:
    """A v2 shard: write `kdflow.schemas.codec.encode(codec, ...)` batches into it."""
    return StreamShardWriter(run_root, path, codec.schema())


def read_stream_table(run_root: RunRoot, path: str) -> pa.Table:
    """Read an IPC stream shard; memory-mapped on local disk, so large shards cost no copy."""
    local = run_root.local_path(path)
    try:
        if local is not None:
            with pa.memory_map(local, "r") as source:
                return ipc.open_stream(source).read_all()
        return ipc.open_stream(io.BytesIO(run_root.read_bytes(path))).read_all()
    except (pa.ArrowInvalid, OSError) as error:
        raise StoreError(f"{run_root.display(path)}: unreadable Arrow shard: {error}") from None


def schema_int(schema: pa.Schema, key: bytes, path: str) -> int:
    """The number a shard's schema metadata holds under `key` (kdflow.seq_len, kdflow.top_k); a StoreError naming
    the shard when it has none. Every reader of top-K and sampled shards checks its shape through it."""
    value = (schema.metadata or {}).get(key)
    if value is None:
        raise StoreError(f"{path}: shard has no {key.decode()} in its schema metadata")
    return int(value)


def stream_schema_ints(run_root: RunRoot, path: str) -> dict[str, int]:
    """seq_len and top_k (where present) from a shard's schema metadata; reads only the stream header."""
    with run_root.open_read(path) as handle:
        metadata = ipc.open_stream(handle).schema.metadata or {}
    return {key.decode().removeprefix("kdflow."): int(value) for key, value in metadata.items()
            if key in (b"kdflow.seq_len", b"kdflow.top_k")}


def read_token_shard(run_root: RunRoot, path: str, seq_len: int | None = None) -> np.ndarray:
    """-> input_ids (rows, seq_len) int32."""
    table = read_stream_table(run_root, path)
    stored = schema_int(table.schema, b"kdflow.seq_len", path)
    if seq_len is not None and stored != seq_len:
        raise StoreError(f"{path}: token shard has seq_len {stored}, expected {seq_len}")
    return _unnest(table.column(INPUT_IDS), stored)


def topk_format(schema: pa.Schema) -> int:
    """1 or 2: the top-K shard format its schema metadata names (v1 shards name none)."""
    value = (schema.metadata or {}).get(META_FORMAT, b"1")
    if value not in (b"1", b"2"):
        raise StoreError(f"top-K shard format {value.decode(errors='replace')!r} is not one this kdflow reads (1, 2)")
    return int(value)


class TopkShard:
    """One top-K shard of either format, opened once (memory-mapped on local disk); rows decoded on demand.

    `read(rows)` -> DecodedTopk: ids (n, T, K) int32 (-1 = padding), logprobs (n, T, K) (v1: as stored, v2:
    float32; -inf = padding), tail (n, T) float32 = log of the teacher's mass outside the kept ids (v2: stored
    at capture; v1: derived as log(1 - sum(exp(logprobs))), -inf where that is <= 0), kept (n, T) int32.
    """

    def __init__(self, run_root: RunRoot, path: str, seq_len: int | None = None, top_k: int | None = None) -> None:
        self.path = run_root.display(path)
        self.table = read_stream_table(run_root, path)
        self.seq_len = schema_int(self.table.schema, b"kdflow.seq_len", path)
        self.top_k = schema_int(self.table.schema, b"kdflow.top_k", path)
        if seq_len is not None and self.seq_len != seq_len:
            raise StoreError(f"{path}: top-K shard has seq_len {self.seq_len}, expected {seq_len}")
        if top_k is not None and self.top_k != top_k:
            raise StoreError(f"{path}: top-K shard has K={self.top_k}, expected K={top_k}")
        self.format = topk_format(self.table.schema)
        self.rows = self.table.num_rows
        self.codec: TopkCodec | None = None
        if self.format == 2:
            try:
                self.codec = TopkCodec.from_schema(self.table.schema)
            except ValueError as error:
                raise StoreError(f"{self.path}: {error}") from None
            if (self.codec.seq_len, self.codec.top_k) != (self.seq_len, self.top_k):
                raise StoreError(f"{self.path}: codec settings disagree with kdflow.seq_len / kdflow.top_k")
        else:
            self.ids = _unnest(self.table.column(TOPK_IDS), self.seq_len, self.top_k)  # (rows, T, K), zero-copy
            self.logprobs = _unnest(self.table.column(TOPK_LOGPROBS), self.seq_len, self.top_k)

    def read(self, rows: Sequence[int] | np.ndarray | None = None) -> DecodedTopk:
        """The given rows (default: all), decoded; a corrupt v2 row raises StoreError naming shard and row."""
        if self.codec is None:
            if rows is None:
                return from_v1(self.ids, self.logprobs)
            picked = np.asarray(rows, dtype=np.int64)
            return from_v1(self.ids[picked], self.logprobs[picked])
        try:
            if rows is None:
                return decode(self.table, codec=self.codec)
            parts = [decode(self.table.slice(int(row), 1), codec=self.codec, row_offset=int(row)) for row in rows]
        except ValueError as error:
            raise StoreError(f"{self.path}: {error}") from None
        if not parts:
            return decode(self.table.slice(0, 0), codec=self.codec)
        return DecodedTopk(*(None if field[0] is None else np.concatenate(field) for field in zip(*parts)))


def read_topk_shard(
    run_root: RunRoot, path: str, seq_len: int | None = None, top_k: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """-> topk_ids (rows, seq_len, K) int32, topk_logprobs (rows, seq_len, K): v1 as stored (float16|float32),
    v2 decoded (float32; adaptive K pads with id -1, log-prob -inf). `TopkShard` also gives the tail."""
    decoded = TopkShard(run_root, path, seq_len, top_k).read()
    return decoded.ids, decoded.logprobs


# --- rows of a shard, decoded: one call on a record batch (or table) of those rows ------------------------
# The student's data path fetches just the rows it needs (kdflow.schemas.shard_rows) and decodes them here.


def decode_token_rows(rows: pa.RecordBatch | pa.Table, seq_len: int) -> np.ndarray:
    """Rows of a token shard -> input_ids (n, seq_len) int32."""
    return _unnest(rows.column(INPUT_IDS), seq_len)


def decode_topk_rows(rows: pa.RecordBatch | pa.Table, seq_len: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a top-K shard -> topk_ids (n, seq_len, K) int32, topk_logprobs (n, seq_len, K) float16|float32."""
    return _unnest(rows.column(TOPK_IDS), seq_len, top_k), _unnest(rows.column(TOPK_LOGPROBS), seq_len, top_k)


def iter_topk_shard(run_root: RunRoot, path: str,
                    seq_len: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A v1 top-K shard record batch by record batch: (topk_ids, topk_logprobs), each (rows, T, K); memory one batch
    (any format, decoded: kdflow.schemas.topk_rows `iter_topk_rows`)."""
    from kdflow.schemas.shard_rows import ShardRows

    for batch in ShardRows(run_root, path, 0).iter_batches():
        stored_len = schema_int(batch.schema, b"kdflow.seq_len", path)
        if seq_len is not None and stored_len != seq_len:
            raise StoreError(f"{path}: top-K shard has seq_len {stored_len}, expected {seq_len}")
        yield decode_topk_rows(batch, stored_len, schema_int(batch.schema, b"kdflow.top_k", path))
