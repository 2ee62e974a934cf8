"""One row of a v2 top-K shard <-> its byte streams: the row-level machinery behind codec.encode/decode
(and, part by part, codec_sampled's).

See codec.py's docstring for the byte layout. Imports only numpy, pyarrow and the standard library.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import numpy as np
import pyarrow as pa

VALUE_KINDS = {"sqrt": 0, "float16": 2, "float32": 4}  # kind -> value bytes (0: quantised, planes vary)
TAIL_KINDS = {"float16": np.float16, "float32": np.float32}
ESCAPE = 255  # gap tokens: 0..254 are the gap, 255 = the gap is 255 + the extra number
LOGPROB_SLACK = 1e-3  # float rounding may put a top log-prob a hair above 0; more is an input error


class RowRenumbering(Protocol):
    """What a row reads of a renumbering table (`codec_meta.Renumbering` is one)."""

    @property
    def rank_of_id(self) -> np.ndarray: ...

    @property
    def id_of_rank_padded(self) -> np.ndarray: ...


class RowCodec(Protocol):
    """What a row's encoding and decoding read of its codec: `codec.TopkCodec`'s settings and the sizes derived from
    them. Described here rather than imported, because codec.py builds on this module, not the other way."""

    @property
    def seq_len(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def values(self) -> str: ...
    @property
    def levels(self) -> int: ...
    @property
    def tail(self) -> str: ...
    @property
    def keep_mass(self) -> float | None: ...
    @property
    def renumbering(self) -> RowRenumbering | None: ...
    @property
    def masked(self) -> bool: ...
    @property
    def normalisation(self) -> str: ...
    @property
    def extra_planes(self) -> int: ...
    @property
    def value_planes(self) -> int: ...
    @property
    def pad_key(self) -> int: ...
    @property
    def level_logprobs(self) -> np.ndarray: ...


def nbytes(max_value: int) -> int:
    """Byte planes needed for numbers up to max_value (at least 1)."""
    return max(1, (int(max_value).bit_length() + 7) // 8)


# --- zstd frames of byte planes -----------------------------------------------------------------------------


def compress(raw: bytes, level: int) -> bytes:
    return pa.Codec("zstd", compression_level=level).compress(raw, asbytes=True) if raw else b""


def decompress(data: bytes | pa.Buffer, size: int, what: str) -> bytes:
    if size == 0 or len(data) == 0:
        if size or len(data):
            raise ValueError(f"{what}: {len(data)} compressed bytes for {size} bytes of data")
        return b""
    try:
        return pa.Codec("zstd").decompress(data, decompressed_size=size, asbytes=True)
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"{what}: corrupt or truncated zstd frame ({error})") from None


def to_planes(values: np.ndarray, count: int) -> list[bytes]:
    """Non-negative ints < 2^32 -> [byte 0 of each, byte 1 of each, ...], `count` planes."""
    return [(values >> (8 * j)).astype(np.uint8).tobytes() for j in range(count)]


def from_planes(raw: bytes, count: int, n_planes: int) -> np.ndarray:
    """Inverse of b"".join(to_planes(values, n_planes)) for `count` values: (count,) uint32."""
    data = np.frombuffer(raw, np.uint8).reshape(n_planes, count)
    out = data[0].astype(np.uint32)
    for j in range(1, n_planes):
        out |= data[j].astype(np.uint32) << (8 * j)
    return out


def _float_key(bits: np.ndarray, width: int) -> np.ndarray:
    """IEEE bits -> order key: ascending key = descending value (NaN excluded); its own inverse."""
    half = np.uint32(1 << (width - 1))
    return np.where(bits >= half, bits, half - np.uint32(1) - bits)


# --- encode one row -----------------------------------------------------------------------------------------


def check_inputs(codec: RowCodec, ids: np.ndarray, logprobs: np.ndarray, tail: np.ndarray,
                 target: np.ndarray | None = None) -> None:
    """Shapes of the whole input; values at the positions with a target only (`target` (rows, T) bool, None: all):
    elsewhere the input may hold anything, it is stored as padding. A top_k codec's tail is not read."""
    shape = (len(ids), codec.seq_len, codec.top_k)
    if ids.shape != shape or logprobs.shape != shape or tail.shape != shape[:2]:
        raise ValueError(f"want ids, logprobs {shape} and tail {shape[:2]}; got {ids.shape}, "
                         f"{logprobs.shape}, {tail.shape}")
    if target is not None:
        if target.shape != shape[:2]:
            raise ValueError(f"want target {shape[:2]}, got {target.shape}")
        ids, logprobs, tail = ids[target], logprobs[target], tail[target]
    padding = (ids < 0) & (logprobs == -np.inf) if codec.keep_mass is not None else False  # never kept: not stored
    if ids.size and (ids.max() >= codec.vocab_size or (ids[~padding] < 0).any()):
        raise ValueError(f"token ids must be in [0, {codec.vocab_size}), got [{ids.min()}, {ids.max()}]"
                         + ("" if codec.keep_mass is not None else "; a position with fewer than top_k entries (id -1, "
                            "log-prob -inf after them) needs adaptive K (keep_mass)"))
    if np.isnan(logprobs).any() or (logprobs > LOGPROB_SLACK).any():
        raise ValueError("topk_logprobs must be log-probabilities: <= 0 and not NaN")
    if codec.normalisation == "full" and (np.isnan(tail).any() or (tail > LOGPROB_SLACK).any()):
        raise ValueError("tail_logprob must be a log-probability: <= 0 and not NaN")
    if (logprobs[..., 1:] > logprobs[..., :-1]).any():
        raise ValueError("topk_logprobs must be sorted descending along K")


def _adaptive(logprobs: np.ndarray, tail: np.ndarray, keep_mass: float) -> tuple[np.ndarray, np.ndarray]:
    """-> kept (T,): fewest leading entries whose mass reaches keep_mass x the top-K mass, >= 1;
    tail (T,) float64: log(exp(tail) + mass of the dropped entries), summed in float64. keep_mass 1 keeps every
    entry but padding (log-prob -inf at the end: a source that held fewer than K), whatever its mass: nothing is
    dropped then, not even entries too small to change a float64 sum."""
    if keep_mass >= 1.0:
        return np.maximum(np.count_nonzero(logprobs > -np.inf, axis=-1), 1), tail
    cumulative = np.cumsum(np.exp(logprobs).astype(np.float64), axis=-1)  # (T, K); exp in float32 is fast
    total = cumulative[:, -1]
    kept = np.minimum(1 + np.count_nonzero(cumulative < keep_mass * total[:, None], axis=-1), logprobs.shape[-1])
    dropped = np.maximum(total - cumulative[np.arange(len(kept)), kept - 1], 0.0)  # 0 where all are kept
    with np.errstate(divide="ignore"):
        return kept, np.log(np.exp(tail.astype(np.float64)) + dropped)


def _value_codes(codec: RowCodec, logprobs: np.ndarray) -> tuple[np.ndarray, int]:
    """-> (codes (T, K) uint32, bits per code): sqrt levels or the IEEE bits."""
    if codec.values == "sqrt":  # round(levels * sqrt(p)), in place on one float32 buffer
        root = logprobs * np.float32(0.5)
        np.exp(root, out=root)
        root *= np.float32(codec.levels)
        levels = np.rint(root, out=root).astype(np.uint32)
        return np.minimum(levels, codec.levels, out=levels), codec.levels.bit_length()
    if codec.values == "float16":
        return logprobs.astype(np.float16).view(np.uint16).astype(np.uint32), 16
    return logprobs.view(np.uint32), 32


def encode_row(codec: RowCodec, ids: np.ndarray, logprobs: np.ndarray, tail: np.ndarray,
               target: np.ndarray | None = None) -> list[bytes]:
    """One row (T, K), (T, K), (T,) -> its streams, uncompressed, in `codec.columns()` order. A masked codec
    stores `target` (T,) bool (None: all True) as a bitmap and only the positions with a target."""
    top_k, vocab = codec.top_k, codec.vocab_size
    cells, kept, mask = [], None, slice(None)
    if codec.masked:
        target = np.ones(len(ids), bool) if target is None else target
        cells.append(np.packbits(target).tobytes())
        ids, logprobs, tail = ids[target], logprobs[target], tail[target]
    if codec.keep_mass is not None:
        kept, tail = _adaptive(logprobs, tail, codec.keep_mass)
        mask = np.arange(top_k) < kept[:, None]  # the leading, kept entries; they stay leading below
        cells.append(b"".join(to_planes(kept - 1, nbytes(top_k - 1))))
    ranks = ids if codec.renumbering is None else np.take(codec.renumbering.rank_of_id, ids, mode="clip")
    if kept is not None:
        ranks = np.where(mask, ranks, vocab)  # dropped entries sort last
    codes, code_bits = _value_codes(codec, logprobs)
    keys = ranks.astype(np.uint32 if code_bits + vocab.bit_length() <= 32 else np.uint64) << code_bits
    keys |= codes
    keys.sort(axis=-1)  # by rank, the values carried along
    ranks = (keys >> code_bits).astype(np.uint32, copy=False)
    codes = (keys & ((1 << code_bits) - 1)).astype(np.uint32, copy=False)
    gaps = np.empty_like(ranks)
    gaps[:, 0], gaps[:, 1:] = ranks[:, 0], ranks[:, 1:] - ranks[:, :-1] - 1  # wraps if an id repeats
    gaps = gaps.ravel() if kept is None else gaps[mask]
    if gaps.max(initial=0) >= vocab:
        raise ValueError("topk_ids repeat an id within a position")
    escaped = gaps >= ESCAPE
    cells.append(np.minimum(gaps, ESCAPE).astype(np.uint8).tobytes())
    extra = gaps[escaped] - ESCAPE
    cells += to_planes(extra, codec.extra_planes)
    if codec.values == "sqrt":
        level_min = (codes if kept is None else np.where(mask, codes, 1 << 16)).min(-1)
        cells.append(b"".join(to_planes(level_min, codec.value_planes)))
        codes = codes - level_min[:, None]  # dropped entries may wrap: they are left out next
    codes = codes.ravel() if kept is None else codes[mask]
    cells += to_planes(codes, codec.value_planes)
    if codec.normalisation != "full":  # the tail is unknown: not stored
        return cells
    tail_bits = np.minimum(tail, 0).astype(TAIL_KINDS[codec.tail])
    tail_bits = tail_bits.view(np.uint16 if codec.tail == "float16" else np.uint32)
    return cells + [b"".join(to_planes(tail_bits, tail_bits.itemsize))]


# --- decode one row -----------------------------------------------------------------------------------------


class RowReader:
    """Hands out one row's decompressed streams in column order (`names`: the columns, for messages), after
    checking the row's crc32. Top-K and sampled shards read their rows through it."""

    def __init__(self, names: list[str], cells: list[pa.Buffer], crc: int, where: str) -> None:
        check = 0
        for cell in cells:
            check = zlib.crc32(cell, check)
        if check != crc:
            raise ValueError(f"{where}: crc32 mismatch, the row's bytes are corrupt or truncated")
        self.cells, self.names, self.where = iter(cells), iter(names), where

    def take(self, size: int) -> bytes:
        return decompress(next(self.cells), size, f"{self.where}, column {next(self.names)}")

    def fail(self, problem: str) -> ValueError:
        return ValueError(f"{self.where}: {problem}")


def _read_ranks(codec: RowCodec, reader: RowReader, kept: np.ndarray | None, count: int) -> np.ndarray:
    """-> ranks of the kept entries, flat, ascending within each position (int32, or int64 if needed)."""
    vocab, top_k = codec.vocab_size, codec.top_k
    wide = np.int32 if top_k * vocab < 1 << 31 else np.int64  # once gaps < vocab, no cumsum overflows
    tokens = np.frombuffer(reader.take(count), np.uint8)
    escaped = np.flatnonzero(tokens == ESCAPE)
    gaps = tokens.astype(wide)
    planes = codec.extra_planes
    gaps[escaped] += from_planes(b"".join(reader.take(len(escaped)) for _ in range(planes)), len(escaped), planes)
    if gaps.max(initial=0) >= vocab:
        raise reader.fail(f"decoded token id beyond vocabulary size {vocab}")
    if kept is None:  # rank_j = gap_0 + ... + gap_j + j
        ranks = np.cumsum(gaps.reshape(-1, top_k), axis=1, dtype=wide) + np.arange(top_k, dtype=wide)
        last = ranks[:, -1]
    else:
        running, ends = np.cumsum(gaps + wide(1), dtype=wide), np.cumsum(kept)
        ranks = running - np.repeat(np.append(wide(0), running[ends[:-1] - 1]), kept) - wide(1)
        last = ranks[ends - 1]
    if last.max(initial=0) >= vocab:
        raise reader.fail(f"decoded token id beyond vocabulary size {vocab}")
    return ranks.ravel()


def _read_keys(codec: RowCodec, reader: RowReader, kept: np.ndarray | None, count: int, seq_len: int
               ) -> np.ndarray:
    """-> order keys of the kept entries, flat uint32, in rank order (ascending key = descending log-prob)."""
    planes = codec.value_planes
    if codec.values == "sqrt":
        top = codec.levels - from_planes(reader.take(seq_len * planes), seq_len, planes).astype(np.int32)
    values = from_planes(b"".join(reader.take(count) for _ in range(planes)), count, planes)
    if codec.values != "sqrt":
        return _float_key(values, 8 * planes)
    values = values.view(np.int32)  # levels - level, level = level_min + value
    keys = (top[:, None] - values.reshape(seq_len, codec.top_k)).ravel() if kept is None else (
        np.repeat(top, kept) - values)
    if keys.min(initial=0) < 0:
        raise reader.fail(f"decoded level beyond levels={codec.levels}")
    return keys.view(np.uint32)


def decode_row(codec: RowCodec, reader: RowReader, order: str, ids: np.ndarray, logprobs: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray | int, np.ndarray | None]:
    """Decode one row into ids (T, K) and logprobs (T, K); -> (tail (T,), kept (T,) or K, target (T,) bool or
    None). Positions without a target decode as padding: ids -1, log-probs -inf, tail -inf, kept 0. A top_k
    codec's tail is NaN: unknown, and never to be read as a mass."""
    if not codec.masked:
        return (*_decode_positions(codec, reader, order, ids, logprobs, codec.seq_len), None)
    seq_len = codec.seq_len
    target = np.unpackbits(np.frombuffer(reader.take((seq_len + 7) // 8), np.uint8), count=seq_len).astype(bool)
    positions = int(target.sum())
    part_ids, part_logprobs = np.empty((positions, *ids.shape[1:]), ids.dtype), np.empty(
        (positions, *logprobs.shape[1:]), logprobs.dtype)
    part_tail, part_kept = (np.empty(0, np.float32), 0) if positions == 0 else _decode_positions(
        codec, reader, order, part_ids, part_logprobs, positions)  # a row without targets stores empty cells
    ids[...], logprobs[...] = -1, -np.inf
    ids[target], logprobs[target] = part_ids, part_logprobs
    tail = np.full(seq_len, -np.inf if codec.normalisation == "full" else np.nan, np.float32)
    tail[target] = part_tail
    kept = np.zeros(seq_len, np.int32)
    kept[target] = part_kept
    return tail, kept, target


def _decode_positions(codec: RowCodec, reader: RowReader, order: str, ids: np.ndarray, logprobs: np.ndarray,
                      seq_len: int) -> tuple[np.ndarray, np.ndarray | int]:
    """Decode `seq_len` stored positions into ids (seq_len, K) and logprobs (seq_len, K); -> (tail, kept)."""
    top_k, vocab = codec.top_k, codec.vocab_size
    kept, mask = np.full(seq_len, top_k), None
    if codec.keep_mass is not None:
        planes = nbytes(top_k - 1)
        kept = from_planes(reader.take(seq_len * planes), seq_len, planes).astype(np.int64) + 1
        if kept.max(initial=0) > top_k:
            raise reader.fail(f"kept count beyond top_k={top_k}")
        mask = np.arange(top_k) < kept[:, None]
    count = seq_len * top_k if mask is None else int(kept.sum())
    ranks = _read_ranks(codec, reader, None if mask is None else kept, count)
    keys = _read_keys(codec, reader, None if mask is None else kept, count, seq_len)
    if mask is None:
        ranks, keys = ranks.reshape(seq_len, top_k), keys.reshape(seq_len, top_k)
    else:  # kept entries first, then padding: rank vocab_size, the key of -inf
        flat_ranks, flat_keys = ranks, keys
        ranks, keys = np.full(mask.shape, vocab, ranks.dtype), np.full(mask.shape, codec.pad_key, np.uint32)
        ranks[mask], keys[mask] = flat_ranks, flat_keys
    if order == "logprob":  # one sort of packed (key, rank): descending log-prob, ties by rank
        rank_bits = vocab.bit_length()
        packed = keys.astype(np.uint32 if rank_bits + codec.pad_key.bit_length() <= 32 else np.uint64)
        packed <<= rank_bits
        packed |= ranks.astype(packed.dtype)
        packed.sort(axis=1)
        ranks, keys = packed & ((1 << rank_bits) - 1), packed >> rank_bits
    if codec.renumbering is not None:
        np.take(codec.renumbering.id_of_rank_padded, ranks, out=ids, mode="clip")  # ranks checked above
    else:
        ids[...] = ranks if mask is None else np.where(ranks < vocab, ranks, -1)
    if codec.values == "sqrt":
        logprobs[...] = np.take(codec.level_logprobs, keys, mode="clip")  # keys checked above
    else:
        bits = _float_key(keys, 8 * codec.value_planes).astype(np.uint16 if codec.values == "float16" else np.uint32)
        logprobs[...] = bits.view(codec.values)
        if not (logprobs <= LOGPROB_SLACK).all():
            raise reader.fail("decoded log-prob is NaN or positive")
    if codec.normalisation != "full":
        return np.full(seq_len, np.nan, np.float32), kept
    tail_bytes = np.dtype(TAIL_KINDS[codec.tail]).itemsize
    tail = from_planes(reader.take(seq_len * tail_bytes), seq_len, tail_bytes)
    tail = tail.astype(np.uint16).view(np.float16) if tail_bytes == 2 else tail.view(np.float32)
    if not (tail <= 0).all():
        raise reader.fail("decoded tail_logprob is NaN or positive")
    return tail, kept
