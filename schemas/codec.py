"""Top-K store v2 codec: the teacher's top-K rows, compact, lossless in ids, randomly accessible by row.

Public API: `TopkCodec` (settings, `settings()` / `settings_json()` for the fingerprint, `schema()`,
`from_schema()`), `encode`, `decode` (the one decode function a reader needs, with plain pyarrow to open the
IPC stream), `DecodedTopk`, `from_v1`. Row-level machinery: codec_rows.py; what it shares with sampled shards
(metadata keys such as `CRC32` and `META_FORMAT`, `Renumbering`, the metadata parser, records): codec_meta.py,
where those names are imported from.
Imports only numpy, pyarrow and the standard library.

Input of `encode`: topk_ids (rows, T, K) int32, sorted by descending log-prob; topk_logprobs (rows, T, K)
float32, normalised over the full vocabulary; tail_logprob (rows, T) float32, the exact log of the mass
outside the K ids (log-sum-exp over the complement, never log(1 - sum(exp))).
Output of `decode`: `DecodedTopk(ids, logprobs, tail, kept, target)`; per position the kept entries come first,
sorted by descending decoded log-prob (ties in renumbered-id order), then padding: id -1, log-prob -inf;
`kept` (n, T) counts them (K everywhere unless adaptive K is on); tail (n, T) float32 <= 0 (-inf: none).

Per position, encode
1. adaptive K (`keep_mass=s`): keeps the fewest leading entries whose mass reaches s x the top-K mass; the
   tail becomes log(exp(tail) + mass of the dropped entries), summed in float64, so it stays exact; `s = 1`
   keeps every entry but padding (id -1, log-prob -inf at the end: an imported position with fewer than K);
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

v3 (codec name kdflow.topk.v3, same container, kdflow.format still 2) is v2 with a target mask and/or top-K
normalisation; its settings add `masked` and `normalisation` (a v2 store's settings, and so its fingerprint,
are unchanged). `masked`: a first column `target` holds the row's packbits(target) (T bits, MSB first), and
every other column holds only the positions whose bit is 1 (a row without targets stores empty cells);
decode gives padding elsewhere (id -1, log-prob -inf, tail -inf, kept 0) and `DecodedTopk.target`.
`normalisation = "top_k"`: the values are log-probs renormalised over the K ids (or raw logits so
renormalised); the teacher's tail is unknown, so no tail column is stored and decode's tail is NaN, never a
zero tail; adaptive K is refused (it would fold mass into that unknown tail).

v1 shards (topk_ids int32, topk_logprobs float16/float32, no tail) map to the same `DecodedTopk` with
`from_v1`: tail = log(clamp(1 - sum(exp(logprobs)), 0, 1)) in float64 (-inf where the clamp bites),
kept = K.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from kdflow.schemas.codec_meta import (CRC32, META_TARGETS, CodecIdentity, Renumbering, codec_from_metadata,
                                      record_batch, row_readers, shard_schema)
from kdflow.schemas.codec_rows import ESCAPE, TAIL_KINDS, VALUE_KINDS, check_inputs, decode_row, encode_row, nbytes

CODEC_NAME = "kdflow.topk.v2"
CODEC_NAME_V3 = "kdflow.topk.v3"  # v2 plus a target mask and/or top-K normalisation: a name old readers refuse
NORMALISATIONS = ("full", "top_k")
TARGETS = "topk"
META_CODEC = b"kdflow.topk_codec"


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
    masked: bool = False  # a per-position target mask is stored (False: no teacher target there)
    normalisation: str = "full"  # "full": log-probs over the whole vocabulary; "top_k": renormalised over the K

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
        if self.normalisation not in NORMALISATIONS:
            raise ValueError(f"normalisation must be one of {list(NORMALISATIONS)}, got {self.normalisation!r}")
        if self.normalisation == "top_k" and self.keep_mass not in (None, 1.0):
            raise ValueError("keep_mass (adaptive K) folds dropped mass into the tail, which a top_k store does not "
                             "know: use keep_mass null (or 1: every entry kept)")

    @property
    def v3(self) -> bool:
        """Whether rows carry a target mask or the values are renormalised over the K: the v3 codec name."""
        return self.masked or self.normalisation != "full"

    def settings(self) -> dict[str, object]:
        """Canonical settings: codec name and every parameter that changes what is stored. A store without mask
        and with full normalisation keeps exactly the v2 settings (and so its fingerprint)."""
        v3 = {"masked": self.masked, "normalisation": self.normalisation} if self.v3 else {}
        return v3 | {
            "codec": CODEC_NAME_V3 if self.v3 else CODEC_NAME, "seq_len": self.seq_len, "top_k": self.top_k,
            "vocab_size": self.vocab_size,
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
        names = ["target"] if self.masked else []
        names += ["kept"] if self.keep_mass is not None else []
        names += ["gap_token"] + [f"gap_extra_b{j}" for j in range(self.extra_planes)]
        names += ["level_min"] if self.values == "sqrt" else []
        names += [f"value_b{j}" for j in range(self.value_planes)]
        return names + (["tail"] if self.normalisation == "full" else [])

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
        codec = codec_from_metadata(cls, metadata, META_CODEC, (CODEC_NAME, CODEC_NAME_V3), _with_levels)
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
    kept: np.ndarray  # (n, T) int32, kept entries per position (0 where there is no target)
    target: np.ndarray | None = None  # (n, T) bool, False: no teacher target (padding there); None: all have one


def encode(codec: TopkCodec, topk_ids: np.ndarray, topk_logprobs: np.ndarray, tail_logprob: np.ndarray | None,
           target: np.ndarray | None = None) -> pa.RecordBatch:
    """(rows, T, K) ids sorted by descending log-prob, (rows, T, K) log-probs, (rows, T) exact tail
    log-mass (a top_k codec ignores it; None there) and `target` (rows, T) bool (None: every position has a
    target; False needs a masked codec) -> one record per row with `codec.schema()`. Positions whose target is
    False may hold anything: they are stored as padding. Raises ValueError on invalid input."""
    ids, logprobs = np.asarray(topk_ids), np.asarray(topk_logprobs, dtype=np.float32)
    if tail_logprob is None and codec.normalisation == "full":
        raise ValueError("a full-normalisation store needs tail_logprob")
    tail = np.zeros(ids.shape[:2], np.float32) if tail_logprob is None else np.asarray(tail_logprob, np.float32)
    mask = None if target is None else np.asarray(target, dtype=bool)
    if mask is not None and not codec.masked and not mask.all():
        raise ValueError("target marks positions without a teacher target, but the codec stores no mask "
                         "(masked=False)")
    mask = mask if codec.masked else None
    check_inputs(codec, ids, logprobs, tail, mask)
    return record_batch(codec, (encode_row(codec, ids[row], logprobs[row], tail[row],
                                           None if mask is None else mask[row]) for row in range(len(ids))))


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
                      np.empty(shape[:2], np.int32), np.empty(shape[:2], bool) if codec.masked else None)
    for row, reader in row_readers(data, codec.columns(), row_offset):
        out.tail[row], out.kept[row], target = decode_row(codec, reader, order, out.ids[row], out.logprobs[row])
        if out.target is not None:
            out.target[row] = target
    return out


def kept_mass_tail(topk_logprobs: np.ndarray) -> np.ndarray:
    """(..., K) log-probs -> (...) float32: the tail of a source that stores none, log(1 - sum p) in float64 clamped
    to [0, 1] (-inf where nothing is left); for v1 shards and imports without a tail column."""
    mass = np.exp(np.asarray(topk_logprobs, dtype=np.float64)).sum(-1)
    with np.errstate(divide="ignore"):
        return np.log(np.clip(1.0 - mass, 0.0, 1.0)).astype(np.float32)


def from_v1(topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> DecodedTopk:
    """v1 arrays (no stored tail) -> DecodedTopk: tail = `kept_mass_tail`, log(clamp(1 - sum(exp), 0, 1))."""
    tail = kept_mass_tail(topk_logprobs)
    kept = np.full(tail.shape, topk_ids.shape[-1], np.int32)
    return DecodedTopk(np.asarray(topk_ids, np.int32), np.asarray(topk_logprobs), tail, kept)
