"""Sampled teacher targets in the v2 format: an exact top-H head plus S sampled tokens per position.

What the fields mean and why the loss on them is unbiased: `kdflow.tasks.common.sampled`. Here, the bytes.
Public API: `SampledCodec` (settings, `settings()` for the fingerprint, `schema()`, `from_schema()`),
`encode_sampled`, `decode_sampled` (the one decode function a reader needs, with plain pyarrow to open the
IPC stream), `DecodedSampled`, `SampledShard`, `shard_targets`; the names and store settings of sampled
targets: `kdflow.schemas.sampled_settings` (re-exported here).

One Arrow record per token row, like v2 top-K shards, built from the same row machinery
(`kdflow.schemas.codec_rows`, the same unigram renumbering table):
    head_*       [hybrid] the head as a v2 top-K of K = H: ids gap-coded in rank space, values as
                 precompute.store says (sqrt levels, float16 or float32), and tail_logprob, the exact log of
                 the mass outside the head (`head_tail`)
    sample_*     the S sampled ids of each position as a set (gap-coded in rank space; the estimator ignores
                 their order) and their log-probs, float16 (default) or float32 IEEE bits; no tail column
    log_threshold  float32, 4 byte planes, one zstd frame (log tau: -inf when the whole tail was sampled; it
                 may be positive). Always float32: every sub-threshold weight is tau, so its rounding would
                 bias all of a position's sampled weights the same way.
    crc32        uint32: zlib.crc32 over the row's binary cells in column order (checked first)
Schema metadata (`codec_meta.shard_schema`, read back by `codec_meta.codec_from_metadata`): kdflow.kind = topk,
kdflow.seq_len, kdflow.top_k = H, kdflow.format = 2, kdflow.targets = hybrid | sampled, kdflow.sampled_codec =
`settings_json()` (codec name, H, S, scheme, seed, hash version, value settings, renumbering sha256),
kdflow.topk_renumbering = the table (as in v2 top-K shards). The top-K reader refuses
these shards (their kdflow.targets is not topk), so no top-K loss ever reads sampled targets by mistake.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from kdflow.schemas.codec import TopkCodec
from kdflow.schemas.codec_meta import (CRC32, META_TARGETS, CodecIdentity, Renumbering, codec_from_metadata,
                                       record_batch, row_readers, shard_schema)
from kdflow.schemas.codec_rows import LOGPROB_SLACK, RowReader, decode_row, encode_row, from_planes, to_planes
from kdflow.schemas.errors import StoreError
from kdflow.schemas.sampled_settings import HASH_VERSION, SAMPLED_KINDS, SCHEMES
from kdflow.schemas.shards import schema_int, read_stream_table
from kdflow.schemas.storage import RunRoot

CODEC_NAME = "kdflow.sampled.v2"
META_SAMPLED = b"kdflow.sampled_codec"


@dataclass(frozen=True, eq=False)
class SampledCodec(CodecIdentity):
    """Settings of a sampled-targets shard; equal codecs have equal `settings()` (the table by its sha256)."""

    seq_len: int
    head: int  # H; 0: `sampled` targets (no head, no tail column: the tail is everything)
    samples: int  # S >= 1
    vocab_size: int
    scheme: str = "priority"
    seed: int = 0
    hash_version: str = HASH_VERSION
    head_values: str = "sqrt"  # the head part, as precompute.store: "sqrt", "float16", "float32"
    levels: int = 400
    tail: str = "float16"
    sample_values: str = "float16"  # "float16" or "float32"
    zstd_level: int = 1
    renumbering: Renumbering | None = None

    def __post_init__(self) -> None:
        if self.samples < 1 or self.head < 0 or self.head + self.samples > self.vocab_size:
            raise ValueError(f"need samples >= 1, head >= 0 and head + samples <= vocab_size, "
                             f"got {self.settings()}")
        if self.scheme not in SCHEMES or self.sample_values not in ("float16", "float32"):
            raise ValueError(f"scheme must be one of {SCHEMES}, sample_values float16 or float32, "
                             f"got {self.settings()}")
        self.sample_codec  # noqa: B018 - TopkCodec checks the rest
        self.head_codec  # noqa: B018

    @property
    def kind(self) -> str:
        return "hybrid" if self.head else "sampled"

    @cached_property
    def head_codec(self) -> TopkCodec | None:
        if not self.head:
            return None
        return TopkCodec(self.seq_len, self.head, self.vocab_size, values=self.head_values, levels=self.levels,
                         tail=self.tail, zstd_level=self.zstd_level, renumbering=self.renumbering)

    @cached_property
    def sample_codec(self) -> TopkCodec:
        return TopkCodec(self.seq_len, self.samples, self.vocab_size, values=self.sample_values,
                         zstd_level=self.zstd_level, renumbering=self.renumbering)

    def settings(self) -> dict[str, object]:
        return {
            "codec": CODEC_NAME, "targets": self.kind, "seq_len": self.seq_len, "head": self.head,
            "samples": self.samples, "vocab_size": self.vocab_size, "scheme": self.scheme, "seed": self.seed,
            "hash_version": self.hash_version, "head_values": self.head_values if self.head else None,
            "levels": self.levels if self.head and self.head_values == "sqrt" else None,
            "tail": self.tail if self.head else None, "sample_values": self.sample_values,
            "zstd_level": self.zstd_level,
            "renumbering": None if self.renumbering is None else "sha256:" + self.renumbering.sha256,
        }

    def columns(self) -> list[str]:
        head = [f"head_{name}" for name in self.head_codec.columns()] if self.head_codec is not None else []
        return head + [f"sample_{name}" for name in self.sample_codec.columns()[:-1]] + ["log_threshold"]

    def schema(self) -> pa.Schema:
        return self._schema

    @cached_property
    def _schema(self) -> pa.Schema:  # top_k: the head's K, so top-K readers get to kdflow.targets
        return shard_schema(self, META_SAMPLED, top_k=self.head, targets=self.kind)

    @classmethod
    def from_schema(cls, schema: pa.Schema) -> SampledCodec:
        """The codec a shard was written with; ValueError when the shard holds no sampled targets or is
        malformed."""
        metadata = schema.metadata or {}
        targets = metadata.get(META_TARGETS, b"topk").decode(errors="replace")
        if targets not in SAMPLED_KINDS or META_SAMPLED not in metadata:
            raise ValueError(f"shard holds {targets!r} targets, not sampled ones ({', '.join(SAMPLED_KINDS)})")
        codec = codec_from_metadata(cls, metadata, META_SAMPLED, CODEC_NAME, _keywords)
        if codec.kind != targets or schema.names != codec.columns() + [CRC32]:
            raise ValueError(f"columns {schema.names} (targets {targets}) do not fit kdflow.sampled_codec")
        return codec


def _keywords(settings: dict[str, object]) -> dict[str, object]:
    """Stored settings -> SampledCodec's keywords: the kind follows from the head; nulls are the defaults."""
    settings.pop("targets")
    return {key: value for key, value in settings.items() if value is not None}


class DecodedSampled(NamedTuple):
    """Rows of sampled targets: (n, T, H), (n, T, H), (n, T), (n, T, S), (n, T, S), (n, T)."""

    head_ids: np.ndarray  # int32, by descending log-prob
    head_logprobs: np.ndarray  # float32
    tail_logprob: np.ndarray  # float32, log of the mass outside the head (0 for `sampled` targets)
    sample_ids: np.ndarray  # int32, in rank order (a set: the estimator ignores the order)
    sample_logprobs: np.ndarray  # float32
    log_threshold: np.ndarray  # float32

    # The head under the names of a decoded top-K (`codec.DecodedTopk`), for readers of either kind.
    @property
    def ids(self) -> np.ndarray:
        return self.head_ids

    @property
    def logprobs(self) -> np.ndarray:
        return self.head_logprobs

    @property
    def tail(self) -> np.ndarray:
        return self.tail_logprob


def _check(codec: SampledCodec, arrays: DecodedSampled) -> None:
    rows = len(arrays.sample_ids)
    t, h, s = codec.seq_len, codec.head, codec.samples
    want = [(rows, t, h), (rows, t, h), (rows, t), (rows, t, s), (rows, t, s), (rows, t)]
    got = [a.shape for a in arrays]
    if got != want:
        raise ValueError(f"sampled targets must have shapes {want}, got {got}")
    for name in ("head_ids", "sample_ids"):
        ids = getattr(arrays, name)
        if ids.size and (ids.min() < 0 or ids.max() >= codec.vocab_size):
            raise ValueError(f"{name} must be in [0, {codec.vocab_size})")
    for name in ("head_logprobs", "sample_logprobs", "tail_logprob"):
        values = getattr(arrays, name)
        if np.isnan(values).any() or (values > LOGPROB_SLACK).any():
            raise ValueError(f"{name} must be log-probabilities: <= 0 and not NaN")
    if np.isnan(arrays.log_threshold).any():
        raise ValueError("log_threshold must not be NaN")
    if h and (arrays.sample_ids[..., :, None] == arrays.head_ids[..., None, :]).any():
        raise ValueError("sample_ids must lie outside the head")


def encode_sampled(codec: SampledCodec, targets: DecodedSampled) -> pa.RecordBatch:
    """Host arrays of one or more token rows (shapes as `DecodedSampled`) -> one record per row."""
    arrays = DecodedSampled(*(np.asarray(a) for a in targets))
    arrays = arrays._replace(head_logprobs=arrays.head_logprobs.astype(np.float32, copy=False),
                             sample_logprobs=arrays.sample_logprobs.astype(np.float32, copy=False),
                             tail_logprob=arrays.tail_logprob.astype(np.float32, copy=False))
    _check(codec, arrays)
    zeros = np.zeros(codec.seq_len, np.float32)

    def cells(row: int) -> list[bytes]:
        out = []
        if codec.head_codec is not None:
            out += encode_row(codec.head_codec, arrays.head_ids[row], arrays.head_logprobs[row],
                              arrays.tail_logprob[row])
        out += encode_row(codec.sample_codec, arrays.sample_ids[row], arrays.sample_logprobs[row], zeros)[:-1]
        out.append(b"".join(to_planes(arrays.log_threshold[row].astype(np.float32).view(np.uint32), 4)))
        return out

    return record_batch(codec, (cells(row) for row in range(len(arrays.sample_ids))))


def decode_sampled(data: pa.RecordBatch | pa.Table, *, codec: SampledCodec | None = None,
                   row_offset: int = 0) -> DecodedSampled:
    """Rows of a sampled-targets shard -> DecodedSampled. ValueError naming the row (numbered from
    `row_offset`) and column when the bytes are corrupt, truncated or inconsistent."""
    codec = codec or SampledCodec.from_schema(data.schema)
    names = codec.columns()
    if data.schema.names != names + [CRC32]:
        raise ValueError(f"columns {data.schema.names} are not {names + [CRC32]}")
    n, t, h, s = data.num_rows, codec.seq_len, codec.head, codec.samples
    out = DecodedSampled(np.empty((n, t, h), np.int32), np.empty((n, t, h), np.float32), np.zeros((n, t), np.float32),
                         np.empty((n, t, s), np.int32), np.empty((n, t, s), np.float32), np.empty((n, t), np.float32))
    for row, reader in row_readers(data, names, row_offset):
        if codec.head_codec is not None:
            out.tail_logprob[row], _, _ = decode_row(codec.head_codec, reader, "logprob", out.head_ids[row],
                                                  out.head_logprobs[row])
        _decode_samples(codec, reader, out, row)
        threshold = from_planes(reader.take(4 * t), t, 4).view(np.float32)
        if np.isnan(threshold).any():
            raise reader.fail("decoded log_threshold is NaN")
        out.log_threshold[row] = threshold
    return out


def _decode_samples(codec: SampledCodec, reader: RowReader, out: DecodedSampled, row: int) -> None:
    class _SampleReader:  # the sample part's streams, then a zero tail where a top-K row has its tail
        def __init__(self) -> None:
            self.left = len(codec.sample_codec.columns()) - 1

        def take(self, size: int) -> bytes:
            if self.left == 0:
                return bytes(size)
            self.left -= 1
            return reader.take(size)

        def fail(self, problem: str) -> ValueError:
            return reader.fail(problem)

    decode_row(codec.sample_codec, _SampleReader(), "rank", out.sample_ids[row], out.sample_logprobs[row])


class SampledShard:
    """One sampled-targets shard, opened once (memory-mapped on local disk); rows decoded on demand."""

    def __init__(self, run_root: RunRoot, path: str, seq_len: int | None = None) -> None:
        self.path = run_root.display(path)
        self.table = read_stream_table(run_root, path)
        self.seq_len = schema_int(self.table.schema, b"kdflow.seq_len", path)
        if seq_len is not None and self.seq_len != seq_len:
            raise StoreError(f"{path}: sampled-targets shard has seq_len {self.seq_len}, expected {seq_len}")
        try:
            self.codec = SampledCodec.from_schema(self.table.schema)
        except ValueError as error:
            raise StoreError(f"{self.path}: {error}") from None
        self.rows = self.table.num_rows

    def read(self, rows: list[int] | np.ndarray | None = None) -> DecodedSampled:
        """The given rows (default: all), decoded; a corrupt row raises StoreError naming the shard and row."""
        try:
            if rows is None:
                return decode_sampled(self.table, codec=self.codec)
            parts = [decode_sampled(self.table.slice(int(r), 1), codec=self.codec, row_offset=int(r)) for r in rows]
        except ValueError as error:
            raise StoreError(f"{self.path}: {error}") from None
        if not parts:
            return decode_sampled(self.table.slice(0, 0), codec=self.codec)
        return DecodedSampled(*(np.concatenate(field) for field in zip(*parts, strict=True)))


def sampled_problems(targets: DecodedSampled, vocab: int | None, row_offset: int = 0) -> list[str]:
    """The sampled-targets contract on decoded rows, one line per failed check (for `kdflow validate`)."""
    def at(mask: np.ndarray) -> str:  # mask (rows, T)
        row, position = np.argwhere(mask)[0][:2]
        return f"row {row_offset + row}, position {position}"

    problems = []
    ids = np.concatenate([targets.head_ids, targets.sample_ids], -1)  # (rows, T, H + S)
    if (ids < 0).any() or (vocab is not None and (ids >= vocab).any()):
        problems.append(f"token id outside [0, {vocab}) at {at(((ids < 0) | (ids >= (vocab or 2**31))).any(-1))}")
    ordered = np.sort(ids, -1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
    if repeated.any():
        problems.append(f"an id appears twice among head and samples at {at(repeated)}")
    values = np.concatenate([targets.head_logprobs, targets.sample_logprobs, targets.tail_logprob[..., None]], -1)
    bad = (np.isnan(values) | (values > LOGPROB_SLACK)).any(-1)
    if bad.any():
        problems.append(f"log-prob NaN or positive at {at(bad)}")
    if np.isnan(targets.log_threshold).any():
        problems.append(f"log_threshold NaN at {at(np.isnan(targets.log_threshold))}")
    mass = np.exp(targets.head_logprobs.astype(np.float64)).sum(-1) + np.exp(targets.tail_logprob.astype(np.float64))
    off = np.abs(mass - 1.0) > 2e-2  # head values quantised (sqrt/400: ~1e-3 per entry), tail float16
    if off.any():
        problems.append(f"head mass + tail mass = {float(mass[off][0]):.4g}, not 1, at {at(off)}")
    return problems


def shard_targets(schema: pa.Schema) -> str:
    """What a top-K store shard holds, from its schema metadata: topk (v1 and v2), hybrid or sampled."""
    return (schema.metadata or {}).get(META_TARGETS, b"topk").decode(errors="replace")
