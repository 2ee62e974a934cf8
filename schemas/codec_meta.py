"""What every v2 shard shares, top-K (`kdflow.schemas.codec`) or sampled (`kdflow.schemas.codec_sampled`).

The format's schema-metadata keys, the renumbering table (`Renumbering`), a codec's identity (its settings:
`CodecIdentity`), the Arrow schema a codec writes (`shard_schema`) and the one parser that reads a codec back
from it (`codec_from_metadata`), and the record layer: each row's cells as zstd frames plus the row's crc32
(`record_batch`, `row_readers`). Byte layouts: codec.py's and codec_sampled.py's docstrings, docs/formats.md.
Imports only numpy, pyarrow and the standard library.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from kdflow.schemas.codec_rows import RowReader, compress, decompress, from_planes, nbytes, to_planes

FORMAT_VERSION = 2
META_FORMAT, META_TARGETS = b"kdflow.format", b"kdflow.targets"
META_TABLE = b"kdflow.topk_renumbering"
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
        """The table a shard's schema carries (base64 under kdflow.topk_renumbering), checked against the sha256 its
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


def codec_from_metadata(cls: type[_Codec], metadata: dict[bytes, bytes], settings_key: bytes,
                        codec_name: str | tuple[str, ...],
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
        names = (codec_name,) if isinstance(codec_name, str) else codec_name
        name = settings.pop("codec")
        if name not in names:
            raise ValueError(f"codec is not {' or '.join(names)}")
        settings = normalise(settings)
        if cls(**settings).settings()["codec"] != name:  # every check but the table's, before it is decoded
            raise ValueError(f"settings {sorted(settings)} are not those of codec {name}")
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"bad {what} metadata: {error}") from None
    table = Renumbering.from_metadata(metadata, digest, settings["vocab_size"], what)
    codec = cls(**settings, renumbering=table)
    if len(_CODECS) < 64:
        _CODECS[key] = codec
    return codec


_Codec = TypeVar("_Codec", bound=CodecIdentity)
_CODECS: dict[tuple[bytes, bytes, bytes | None], Any] = {}  # (key, settings JSON, table) -> parsed and checked


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
