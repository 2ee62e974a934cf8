"""Top-K store v2 codec: the teacher's top-K rows, compact, lossless in ids, randomly accessible by row.

Public API: `TopkCodec` (settings, `settings()` / `settings_json()` for the fingerprint, `schema()`,
`from_schema()`), `Renumbering`, `encode`, `decode` (the one decode function a reader needs, with plain
pyarrow to open the IPC stream), `DecodedTopk`, `from_v1`. Row-level machinery: codec_rows.py.
Imports only numpy, pyarrow and the standard library.

Input of `encode`: topk_ids (rows, T, K) int32, sorted by descending log-prob; topk_logprobs (rows, T, K)
float32, normalised over the full vocabulary; tail_logprob (rows, T) float32, the exact log of the mass
outside the K ids (log-sum-exp over the complement, never log(1 - sum(exp))).
Output of `decode`: `DecodedTopk(ids, logprobs, tail, kept)`; per position the kept entries come first,
sorted by descending decoded log-prob (ties in renumbered-id order), then padding: id -1, log-prob -inf;
`kept` (n, T) counts them (K everywhere unless adaptive K is on); tail (n, T) float32 <= 0 (-inf: none).

Per position, encode
1. adaptive K (`keep_mass=s`): keeps the fewest leading entries whose mass reaches s x the top-K mass; the
   tail becomes log(exp(tail) + mass of the dropped entries), summed in float64, so it stays exact;
2. renumbers ids (`Renumbering`, e.g. by frequency: rank 0 = most frequent) and sorts the kept entries by
   rank; gap_j = rank_j - rank_(j-1) - 1 >= 0 (rank_(-1) = -1), so ids are distinct by construction;
3. codes each value in that rank order: "sqrt" -> level q = round(L sqrt(p)) in [0, L], decoded as
   p = (q / L)^2 (q = 0 as (1 / 4L)^2): |sqrt(p_decoded) - sqrt(p)| <= 1 / 2L for every entry, so each
   entry costs about the same KL, ~1 / 6L^2 nats (K = 128, L = 400: ~1.3e-4 per position), and the
   log-prob error grows as p shrinks; the position's lowest level is stored once and subtracted.
   "float16" / "float32": the IEEE bits, lossless.

Byte layout. One Arrow record per token row; every column but crc32 is `binary` holding one zstd frame
(b"" for an empty stream) of little-endian byte *planes*: byte 0 of each number, then byte 1 of each, ...
(planes let zstd's Huffman stage approach the order-0 entropy of each byte).
    kept         [adaptive only] kept - 1 per position, bytes(K - 1) planes in one frame       T numbers
    gap_token    min(gap, 255) per entry, one byte                                               N bytes
    gap_extra_bJ plane J of gap - 255 for the entries whose token is 255; J < bytes(V - 256)      E bytes
    level_min    ["sqrt" only] the position's lowest level, bytes(L) planes in one frame          T numbers
    value_bJ     plane J of each value: "sqrt": level - level_min, bytes(L) planes; "float16": 2; "float32": 4
    tail         tail log-prob as float16 (2 planes) or float32 (4 planes), one frame             T numbers
    crc32        uint32: zlib.crc32 over the row's binary cells in column order (checked first)
N = kept entries in the row (T x K without adaptive K), E = escaped gaps; values are in gap order.
Schema metadata: kdflow.kind = topk, kdflow.seq_len, kdflow.top_k (as in v1), kdflow.format = 2 (v1 shards
have none), kdflow.targets = topk (what the rows hold: room for other kinds of targets in the same format;
this reader refuses any other), kdflow.topk_codec = `settings_json()` (codec name + parameters + renumbering
sha256) and, with a renumbering, kdflow.topk_renumbering = base64(`Renumbering.to_bytes()`) (15 KB for the
SmolLM2 demo's unigram table, ~245 KB for a full 196,608). Every shard carries its own table: a shard
copied alone still decodes.

v1 shards (topk_ids int32, topk_logprobs float16/float32, no tail) map to the same `DecodedTopk` with
`from_v1`: tail = log(clamp(1 - sum(exp(logprobs)), 0, 1)) in float64 (-inf where the clamp bites),
kept = K.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator
from functools import cached_property
from typing import Any, NamedTuple, TypeVar

import numpy as np
import pyarrow as pa

from kdflow.schemas.codec_rows import (ESCAPE, TAIL_KINDS, VALUE_KINDS, RowReader, check_inputs, compress,
                                      decode_row, decompress, encode_row, from_planes, nbytes, to_planes)

CODEC_NAME = "kdflow.topk.v2"
FORMAT_VERSION = 2
TARGETS = "topk"
META_FORMAT, META_TARGETS = b"kdflow.format", b"kdflow.targets"
META_CODEC, META_TABLE = b"kdflow.topk_codec", b"kdflow.topk_renumbering"
CRC32 = "crc32"


class Renumbering:
    """A permutation of token ids, id_of_rank[rank] = id; gaps are coded in rank space (small ranks = dense)."""

    def __init__(self, id_of_rank: np.ndarray) -> None:
        id_of_rank = np.ascontiguousarray(id_of_rank, dtype=np.int32)
        rank_of_id = np.full(len(id_of_rank), -1, np.int32)
        rank_of_id[id_of_rank.clip(0, len(id_of_rank) - 1)] = np.arange(len(id_of_rank), dtype=np.int32)
        if id_of_rank.ndim != 1 or (rank_of_id < 0).any():
            raise ValueError("renumbering table is not a permutation of range(vocab_size)")
        self.id_of_rank, self.rank_of_id = id_of_rank, rank_of_id
        self.id_of_rank_padded = np.append(id_of_rank, np.int32(-1))  # rank vocab_size = padding
        self.sha256 = hashlib.sha256(id_of_rank.astype("<i4").tobytes()).hexdigest()

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> Renumbering:
        """Most frequent first, ties by id: deterministic, so parallel writers agree (e.g. unigram counts)."""
        return cls(np.argsort(-np.asarray(counts, dtype=np.int64), kind="stable"))

    def to_bytes(self) -> bytes:
        """Zigzag deltas of id_of_rank as byte planes, zstd level 19: once per store, 10-180 KB."""
        delta = np.diff(self.id_of_rank.astype(np.int64), prepend=0)
        zigzag = ((delta << 1) ^ (delta >> 63)).astype(np.uint32)
        return compress(b"".join(to_planes(zigzag, nbytes(2 * len(delta)))), 19)

    @classmethod
    def from_bytes(cls, data: bytes, vocab_size: int) -> Renumbering:
        planes = nbytes(2 * vocab_size)
        zigzag = from_planes(decompress(data, planes * vocab_size, "renumbering table"), vocab_size, planes)
        delta = (zigzag >> 1).astype(np.int64) ^ -(zigzag & 1).astype(np.int64)
        return cls(np.cumsum(delta))

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes], digest: str | None, vocab_size: int,
                      what: str) -> Renumbering | None:
        """The table a shard's schema carries (base64 under kdflow.renumbering), checked against the sha256 its
        codec settings (`what`) name; None when they name none."""
        if digest is None:
            return None
        if META_TABLE not in metadata:
            raise ValueError("shard names a renumbering table but does not carry it")
        table = cls.from_bytes(base64.b64decode(metadata[META_TABLE]), vocab_size)
        if "sha256:" + table.sha256 != digest:
            raise ValueError(f"renumbering table does not match its sha256 in {what}")
        return table


class CodecIdentity:
    """A codec is its settings: equal, hashed and serialised through `settings()` (what changes the bytes)."""

    def settings(self) -> dict[str, object]:
        raise NotImplementedError

    def settings_json(self) -> str:
        return json.dumps(self.settings(), sort_keys=True, separators=(",", ":"))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.settings() == other.settings()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.settings_json())


def shard_schema(codec: Any, settings_key: bytes, *, top_k: int, targets: str) -> pa.Schema:
    """The Arrow schema of a v2 shard (top-K or sampled): the codec's binary columns and crc32; in its
    metadata the v1 keys (kind, seq_len, top_k), the format, the targets, the codec's settings under
    `settings_key` and its renumbering table."""
    metadata = {b"kdflow.kind": b"topk", b"kdflow.seq_len": str(codec.seq_len).encode(),
                b"kdflow.top_k": str(top_k).encode(), META_FORMAT: str(FORMAT_VERSION).encode(),
                META_TARGETS: targets.encode(), settings_key: codec.settings_json().encode()}
    if codec.renumbering is not None:
        metadata[META_TABLE] = base64.b64encode(codec.renumbering.to_bytes())
    fields = [pa.field(name, pa.binary(), nullable=False) for name in codec.columns()]
    return pa.schema(fields + [pa.field(CRC32, pa.uint32(), nullable=False)], metadata=metadata)


def codec_from_metadata(cls: type[_Codec], metadata: dict[bytes, bytes], settings_key: bytes, codec_name: str,
                        normalise: Callable[[dict[str, object]], dict[str, object]]) -> _Codec:
    """The codec `cls` that a v2 shard's metadata names under `settings_key` (its `settings_json()`, then
    `normalise`d into `cls`'s keywords), with the renumbering table it carries, checked against the sha256
    the settings name. ValueError on malformed metadata. Parsed once per distinct (settings, table)."""
    key = (settings_key, metadata[settings_key], metadata.get(META_TABLE))
    codec = _CODECS.get(key)
    if codec is not None:
        return codec
    what = settings_key.decode()
    try:
        settings = json.loads(metadata[settings_key])
        digest = settings.pop("renumbering")
        if settings.pop("codec") != codec_name:
            raise ValueError(f"codec is not {codec_name}")
        settings = normalise(settings)
        cls(**settings)  # every check but the table's, before the table is decoded
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"bad {what} metadata: {error}") from None
    table = Renumbering.from_metadata(metadata, digest, settings["vocab_size"], what)
    codec = cls(**settings, renumbering=table)
    if len(_CODECS) < 64:
        _CODECS[key] = codec
    return codec


_Codec = TypeVar("_Codec", bound=CodecIdentity)
_CODECS: dict[tuple[bytes, bytes, bytes | None], Any] = {}  # (key, settings JSON, table) -> parsed and checked


@dataclass(frozen=True, eq=False)
class TopkCodec(CodecIdentity):
    """The v2 codec's settings; `settings()` is what goes in schema metadata and the store fingerprint.
    Two codecs are equal when their settings are (the renumbering table by its sha256)."""

    seq_len: int
    top_k: int
    vocab_size: int
    values: str = "sqrt"  # "sqrt" (quantised: step 1/levels in sqrt(p)), "float16", "float32" (lossless)
    levels: int = 400  # "sqrt" only, 1..65535; KL ~ top_k / (6 levels^2) nats/position
    tail: str = "float16"  # storage of tail_logprob: "float16" (2 B) or "float32" (4 B)
    keep_mass: float | None = None  # adaptive K: keep entries until this share of the top-K mass
    zstd_level: int = 1
    renumbering: Renumbering | None = None

    def __post_init__(self) -> None:
        if min(self.seq_len, self.top_k, self.vocab_size) < 1 or self.top_k > self.vocab_size:
            raise ValueError(f"need seq_len, top_k >= 1 and top_k <= vocab_size, got {self.settings()}")
        if self.values not in VALUE_KINDS or self.tail not in TAIL_KINDS:
            raise ValueError(f"values must be one of {list(VALUE_KINDS)}, tail one of {list(TAIL_KINDS)}")
        if self.values == "sqrt" and not 1 <= self.levels <= 65535:
            raise ValueError(f"levels must be in 1..65535, got {self.levels}")
        if self.keep_mass is not None and not 0.0 < self.keep_mass <= 1.0:
            raise ValueError(f"keep_mass must be in (0, 1], got {self.keep_mass}")
        if self.renumbering is not None and len(self.renumbering.id_of_rank) != self.vocab_size:
            raise ValueError(f"renumbering covers {len(self.renumbering.id_of_rank)} ids, not {self.vocab_size}")

    def settings(self) -> dict[str, object]:
        """Canonical settings: codec name and every parameter that changes what is stored."""
        return {
            "codec": CODEC_NAME, "seq_len": self.seq_len, "top_k": self.top_k, "vocab_size": self.vocab_size,
            "values": self.values, "levels": self.levels if self.values == "sqrt" else None,
            "tail": self.tail, "keep_mass": self.keep_mass, "zstd_level": self.zstd_level,
            "renumbering": None if self.renumbering is None else "sha256:" + self.renumbering.sha256,
        }

    @property
    def extra_planes(self) -> int:
        return nbytes(max(self.vocab_size - 1 - ESCAPE, 0))

    @property
    def pad_key(self) -> int:
        """The order key of -inf: padding, sorted last."""
        return {"sqrt": self.levels + 1, "float16": 0xFC00, "float32": 0xFF800000}[self.values]

    @property
    def value_planes(self) -> int:
        return VALUE_KINDS[self.values] or nbytes(self.levels)

    def columns(self) -> list[str]:
        names = ["kept"] if self.keep_mass is not None else []
        names += ["gap_token"] + [f"gap_extra_b{j}" for j in range(self.extra_planes)]
        names += ["level_min"] if self.values == "sqrt" else []
        return names + [f"value_b{j}" for j in range(self.value_planes)] + ["tail"]

    def schema(self) -> pa.Schema:
        """Arrow schema of a shard, codec settings and renumbering table in its metadata (built once)."""
        return self._schema

    @cached_property
    def _schema(self) -> pa.Schema:
        return shard_schema(self, META_CODEC, top_k=self.top_k, targets=TARGETS)

    @cached_property
    def level_logprobs(self) -> np.ndarray:
        """"sqrt": float32 log-prob of each order key levels - q (q = 0 as sqrt(p) = 1/4L); key L+1: -inf."""
        roots = np.arange(self.levels, -1, -1, dtype=np.float64) / self.levels
        roots[-1] = 0.25 / self.levels  # level 0 stands for sqrt(p) in [0, 1/2L): decode at its middle
        return np.append(2.0 * np.log(roots), -np.inf).astype(np.float32)

    @classmethod
    def from_schema(cls, schema: pa.Schema) -> TopkCodec:
        """The codec a shard was written with (parsed once per distinct settings, then cached)."""
        metadata = schema.metadata or {}
        targets = metadata.get(META_TARGETS, TARGETS.encode()).decode(errors="replace")
        if targets != TARGETS:
            raise ValueError(f"shard holds {targets!r} targets: this reader decodes {TARGETS!r} only")
        if META_CODEC not in metadata:
            raise ValueError("not a v2 top-K shard: no kdflow.topk_codec in the schema metadata")
        codec = codec_from_metadata(cls, metadata, META_CODEC, CODEC_NAME, _with_levels)
        if schema.names != codec.columns() + [CRC32]:
            raise ValueError(f"columns {schema.names} are not {codec.columns() + [CRC32]}")
        return codec


def _with_levels(settings: dict[str, object]) -> dict[str, object]:
    settings["levels"] = settings["levels"] or 400  # stored as null when values are not "sqrt"
    return settings


class DecodedTopk(NamedTuple):
    ids: np.ndarray  # (n, T, K) int32, -1 = padding
    logprobs: np.ndarray  # (n, T, K) float32 or float16, -inf = padding
    tail: np.ndarray  # (n, T) float32, log of the mass outside the kept ids
    kept: np.ndarray  # (n, T) int32, kept entries per position


def encode(codec: TopkCodec, topk_ids: np.ndarray, topk_logprobs: np.ndarray,
           tail_logprob: np.ndarray) -> pa.RecordBatch:
    """(rows, T, K) ids sorted by descending log-prob, (rows, T, K) log-probs, (rows, T) exact tail
    log-mass -> one record per row with `codec.schema()`. Raises ValueError on invalid input."""
    ids, logprobs = np.asarray(topk_ids), np.asarray(topk_logprobs, dtype=np.float32)
    tail = np.asarray(tail_logprob, dtype=np.float32)
    check_inputs(codec, ids, logprobs, tail)
    return record_batch(codec, (encode_row(codec, ids[row], logprobs[row], tail[row]) for row in range(len(ids))))


def decode(data: pa.RecordBatch | pa.Table, *, order: str = "logprob", dtype: type = np.float32,
           codec: TopkCodec | None = None, row_offset: int = 0) -> DecodedTopk:
    """Rows of a v2 shard (a batch, a table, or any slice of one) -> DecodedTopk; see the module docstring.

    order="logprob": per position by descending log-prob (the v1 contract); "rank": in stored (renumbered
    id) order, faster, for consumers that do not care. dtype: float32 or float16 log-probs.
    Raises ValueError naming the row (numbered from `row_offset`) and column when the bytes are corrupt,
    truncated or inconsistent."""
    if order not in ("logprob", "rank"):
        raise ValueError(f"order must be 'logprob' or 'rank', got {order!r}")
    codec = codec or TopkCodec.from_schema(data.schema)
    if data.schema.names != codec.columns() + [CRC32]:
        raise ValueError(f"columns {data.schema.names} are not {codec.columns() + [CRC32]}")
    shape = (data.num_rows, codec.seq_len, codec.top_k)
    out = DecodedTopk(np.empty(shape, np.int32), np.empty(shape, dtype), np.empty(shape[:2], np.float32),
                      np.empty(shape[:2], np.int32))
    for row, reader in row_readers(data, codec.columns(), row_offset):
        out.tail[row], out.kept[row] = decode_row(codec, reader, order, out.ids[row], out.logprobs[row])
    return out


def record_batch(codec: Any, rows: Iterable[list[bytes]]) -> pa.RecordBatch:
    """Each row's raw cells (in `codec.columns()` order) -> one record per row with `codec.schema()`: a zstd
    frame per cell, then crc32 over the row's frames. Top-K and sampled shards are written through it."""
    columns: list[list[bytes]] = [[] for _ in codec.columns()]
    crcs = []
    for cells in rows:
        crc = 0
        for column, cell in zip(columns, cells, strict=True):
            column.append(compress(cell, codec.zstd_level))
            crc = zlib.crc32(column[-1], crc)
        crcs.append(crc)
    arrays = [pa.array(column, pa.binary()) for column in columns] + [pa.array(crcs, pa.uint32())]
    return pa.record_batch(arrays, schema=codec.schema())


def row_readers(data: pa.RecordBatch | pa.Table, names: list[str],
                row_offset: int) -> Iterator[tuple[int, RowReader]]:
    """(row, its `RowReader`) for each row of a v2 shard's `data` with columns `names` (+ crc32); rows are
    numbered from 0, messages from `row_offset`."""
    row = 0
    for batch in data.to_batches() if isinstance(data, pa.Table) else [data]:
        columns = [batch.column(name) for name in names]
        crcs = batch.column(CRC32).to_numpy(zero_copy_only=False)
        for index in range(batch.num_rows):
            cells = [column[index].as_buffer() or pa.py_buffer(b"") for column in columns]
            yield row, RowReader(names, cells, int(crcs[index]), f"row {row + row_offset}")
            row += 1


def from_v1(topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> DecodedTopk:
    """v1 arrays (no stored tail) -> DecodedTopk: tail = log(clamp(1 - sum(exp), 0, 1)), -inf when <= 0."""
    mass = np.exp(np.asarray(topk_logprobs, dtype=np.float64)).sum(-1)
    with np.errstate(divide="ignore"):
        tail = np.log(np.clip(1.0 - mass, 0.0, 1.0)).astype(np.float32)
    kept = np.full(tail.shape, topk_ids.shape[-1], np.int32)
    return DecodedTopk(np.asarray(topk_ids, np.int32), np.asarray(topk_logprobs), tail, kept)
