"""DistillKit's packed logit captures (arcee-ai/DistillKit) as SourceRows, and kdflow targets written that way.

A capture row holds `input_ids` [L] and, per position, `compressed_logprobs` and `bytepacked_indices` (bytes laid
out by the compressor settings, see distillkit_bytes.py). Position t holds the teacher's top-k for the token after
t, as log-probs over the full vocabulary: DistillKit's capture asks vLLM for raw log-probs of the prompt and its
trainer treats the mass outside the k as missing probability, so the normalisation is FULL and the tail is
1 - sum p. A fresh capture has one position fewer than tokens (the last token predicts nothing); its packing
step trims `input_ids` to the positions. Optional `labels` (< 0: no target, as DistillKit's trainer masks) and
`attention_mask` (0: padding, dropped) are honoured. docs/formats.md, "DistillKit's packed format", says more.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.tasks.teacher.distillkit_bytes import decode_logprobs, encode_logprobs, pack_bits, unpack_bits
from kdflow.tasks.teacher.distillkit_settings import DistillKitSettings
from kdflow.tasks.teacher.source_rows import FULL, SourceRows

TOKENS, LOGPROBS, INDICES = "input_ids", "compressed_logprobs", "bytepacked_indices"
LABELS, ATTENTION = "labels", "attention_mask"
LEGACY_COLUMNS = ("packed_indices", "exact_values", "coeffs")  # DistillKit's older format, not read
IGNORE_LABEL = -100  # what the writer puts in `labels` at positions without a target (the transformers value)


def is_distillkit(column_names: list[str]) -> bool:
    """Whether a source's columns are DistillKit's packed ones (for an importer that recognises the format)."""
    return {TOKENS, LOGPROBS, INDICES} <= set(column_names)


def _column(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    index = batch.schema.get_field_index(name)
    return None if index < 0 else batch.column(index)


def _flat(array: pa.Array, field: str, first_row: int, depth: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A list column `depth` levels deep -> its values and each level's offsets, refusing nulls and non-lists."""
    offsets = []
    for level in range(depth):
        if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
            raise StoreError(f"row {first_row} field {field}: not a list{' of lists' * (depth - 1 - level)} "
                             f"(type {array.type})")
        if array.null_count:
            bad = int(np.flatnonzero(np.asarray(array.is_null()))[0])
            row, position = (bad, None) if level == 0 else _row_of(offsets[0], bad)
            at = "" if position is None else f" at position {position}"
            raise StoreError(f"row {first_row + row} field {field}: a null list{at}")
        starts = np.asarray(array.offsets, dtype=np.int64)
        offsets.append(starts - starts[0])
        array = array.flatten()
    if array.null_count:
        raise StoreError(f"row {first_row} field {field}: a null value")
    return array.to_numpy(zero_copy_only=False), offsets


def _row_of(offsets: np.ndarray, index: int) -> tuple[int, int]:
    """Flat index -> (row, index within the row) under `offsets`."""
    row = int(np.searchsorted(offsets, index, side="right") - 1)
    return row, index - int(offsets[row])


def _integers(values: np.ndarray, field: str, first_row: int) -> np.ndarray:
    if values.dtype.kind not in "iu":
        raise StoreError(f"row {first_row} field {field}: values of type {values.dtype}, not integers")
    return values.astype(np.int64)


def _packed(array: pa.Array, field: str, width: int, first_row: int) -> tuple[np.ndarray, np.ndarray]:
    """A `[P][bytes]` column -> ((positions, width) uint8, positions per row offsets), each entry `width` long."""
    values, (rows, positions) = _flat(array, field, first_row, 2)
    lengths = np.diff(positions)
    wrong = np.flatnonzero(lengths != width)
    if len(wrong):
        row, position = _row_of(rows, int(wrong[0]))
        raise StoreError(f"row {first_row + row} field {field}: position {position} has {lengths[wrong[0]]} "
                         f"bytes, the compressor settings give {width}")
    if len(values) and (values.dtype.kind not in "iu" or values.min() < 0 or values.max() > 255):
        raise StoreError(f"row {first_row} field {field}: entries are not bytes (type {array.type})")
    return values.astype(np.uint8).reshape(-1, width), rows


def _check_decoded(ids: np.ndarray, logprobs: np.ndarray, vocab_size: int, offsets: np.ndarray,
                   first_row: int) -> None:
    """Ids inside the vocabulary and distinct per position; log-probs a number or -inf (a slot left empty)."""
    checks = ((ids >= vocab_size) & (ids >= 0), INDICES, f"an id outside the vocabulary of {vocab_size}"),
    checks += (np.isnan(logprobs) | (logprobs == np.inf), LOGPROBS, "log-probs that do not decode to numbers"),
    ordered = np.sort(np.where(ids < 0, -1 - np.arange(ids.shape[1]), ids), axis=1)
    checks += (np.diff(ordered, axis=1) == 0, INDICES, "a repeated id"),
    for bad, field, problem in checks:
        hit = np.flatnonzero(bad.any(axis=1))
        if len(hit):
            row, position = _row_of(offsets, int(hit[0]))
            raise StoreError(f"row {first_row + row} field {field}: {problem} at position {position}")


def _canonical(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted by descending log-prob (the curve need not keep the order), and never more than the full mass:
    where approximation made the kept probabilities sum above 1, they are scaled down to sum to exactly 1."""
    order = np.argsort(-logprobs, axis=1, kind="stable")
    ids, logprobs = np.take_along_axis(ids, order, 1), np.take_along_axis(logprobs, order, 1)
    top = np.where(np.isfinite(logprobs[:, :1]), logprobs[:, :1], 0.0)  # an all-empty position sums to 0
    with np.errstate(divide="ignore"):
        total = top[:, 0] + np.log(np.exp(logprobs - top).sum(axis=1))
    over = total > 0
    logprobs[over] -= total[over, None]
    return ids, logprobs


def distillkit_rows(batch: pa.RecordBatch, settings: DistillKitSettings, first_row: int, top_k: int,
                    vocab_size: int) -> SourceRows:
    """Rows [first_row, first_row + len(batch)) of a DistillKit capture, decoded and checked.

    `top_k` is the store's K: a capture with more keeps its top_k most likely ids (the rest join the tail), one
    with fewer pads with id -1 and log-prob -inf. Every problem is one StoreError naming the row and field."""
    for name in LEGACY_COLUMNS:
        if _column(batch, name) is not None:
            raise StoreError(f"row {first_row} field {name}: DistillKit's legacy compressed format (packed_indices, "
                             "exact_values, coeffs) is not supported")
    for name in (TOKENS, LOGPROBS, INDICES):
        if _column(batch, name) is None:
            raise StoreError(f"row {first_row} field {name}: DistillKit's packed format needs this column")
    values, (token_offsets,) = _flat(_column(batch, TOKENS), TOKENS, first_row, 1)
    tokens = _integers(values, TOKENS, first_row)
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if len(bad):
        row, position = _row_of(token_offsets, int(bad[0]))
        raise StoreError(f"row {first_row + row} field {TOKENS}: token {tokens[bad[0]]} at position {position} "
                         f"is outside the vocabulary of {vocab_size}")
    raw_logprobs, positions = _packed(_column(batch, LOGPROBS), LOGPROBS, settings.logprob_bytes(), first_row)
    raw_ids, id_positions = _packed(_column(batch, INDICES), INDICES, settings.index_bytes(), first_row)
    counts, lengths = np.diff(positions), np.diff(token_offsets)
    for field, got in ((LOGPROBS, counts), (INDICES, np.diff(id_positions))):
        wrong = np.flatnonzero((got != lengths) & (got != lengths - 1))
        if len(wrong):
            row = int(wrong[0])
            raise StoreError(f"row {first_row + row} field {field}: {got[row]} positions for {lengths[row]} "
                             f"{TOKENS} (DistillKit stores one per token, or one fewer)")
    if not np.array_equal(counts, np.diff(id_positions)):
        row = int(np.flatnonzero(counts != np.diff(id_positions))[0])
        raise StoreError(f"row {first_row + row} field {INDICES}: not as many positions as {LOGPROBS}")
    logprobs = decode_logprobs(raw_logprobs, settings)
    ids = unpack_bits(raw_ids, settings.index_bits, settings.k).astype(np.int64)
    ids[np.isneginf(logprobs)] = -1  # a slot the capture left empty (vLLM gave fewer than k) is padding
    _check_decoded(ids, logprobs, vocab_size, positions, first_row)
    ids, logprobs = _canonical(ids, logprobs)
    row_of_token = np.repeat(np.arange(len(lengths)), lengths)
    has_target = np.arange(len(tokens)) - token_offsets[row_of_token] < counts[row_of_token]
    keep = min(top_k, settings.k)
    full_ids = np.full((len(tokens), top_k), -1, dtype=np.int32)
    full_logprobs = np.full((len(tokens), top_k), -np.inf, dtype=np.float32)
    full_ids[has_target, :keep] = ids[:, :keep]
    full_logprobs[has_target, :keep] = logprobs[:, :keep]
    target = has_target & _labelled(batch, token_offsets, first_row)
    kept = _unpadded(batch, token_offsets, first_row)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(row_of_token[kept], minlength=len(lengths)))])
    return SourceRows(first_row=first_row, offsets=offsets.astype(np.int64), tokens=tokens[kept].astype(np.int32),
                      ids=full_ids[kept], logprobs=full_logprobs[kept], target=target[kept], tail=None, text=None,
                      normalisation=FULL)


def _per_token(batch: pa.RecordBatch, name: str, token_offsets: np.ndarray, first_row: int) -> np.ndarray | None:
    """An optional `[L]` column (labels, attention_mask) as flat integers, its lengths checked against the tokens."""
    column = _column(batch, name)
    if column is None:
        return None
    values, (offsets,) = _flat(column, name, first_row, 1)
    wrong = np.flatnonzero(np.diff(offsets) != np.diff(token_offsets))
    if len(wrong):
        row = int(wrong[0])
        raise StoreError(f"row {first_row + row} field {name}: {np.diff(offsets)[row]} values for "
                         f"{np.diff(token_offsets)[row]} {TOKENS}")
    return _integers(values, name, first_row)


def _labelled(batch: pa.RecordBatch, token_offsets: np.ndarray, first_row: int) -> np.ndarray:
    labels = _per_token(batch, LABELS, token_offsets, first_row)
    return np.ones(int(token_offsets[-1]), dtype=bool) if labels is None else labels >= 0


def _unpadded(batch: pa.RecordBatch, token_offsets: np.ndarray, first_row: int) -> np.ndarray:
    mask = _per_token(batch, ATTENTION, token_offsets, first_row)
    return np.ones(int(token_offsets[-1]), dtype=bool) if mask is None else mask != 0


def _nested(flat: np.ndarray, per_row: int, value_type: pa.DataType) -> pa.Array:
    """(rows * per_row, width) -> a `[per_row][width]` list column without a Python loop."""
    positions, width = flat.shape
    inner = pa.ListArray.from_arrays(pa.array(np.arange(positions + 1, dtype=np.int32) * width),
                                     pa.array(flat.reshape(-1), type=value_type))
    return pa.ListArray.from_arrays(pa.array(np.arange(positions // per_row + 1, dtype=np.int32) * per_row), inner)


def distillkit_table(input_ids: np.ndarray, ids: np.ndarray, logprobs: np.ndarray, settings: DistillKitSettings,
                     target: np.ndarray | None = None) -> pa.Table:
    """kdflow rows (rows, T) tokens with (rows, T, K) ids and log-probs -> DistillKit's packed rows.

    Rows come out as DistillKit's packing step leaves them: `input_ids` as long as the positions. With `target`
    given, `labels` marks positions without a target with -100 (their ids and log-probs are placeholders), the
    mask DistillKit's trainer applies. The compressor settings must fit: K >= k, ids below 2**ceil(log2(d))."""
    input_ids, ids = np.asarray(input_ids, np.int64), np.asarray(ids, np.int64)
    logprobs = np.asarray(logprobs, np.float64)
    rows, length = input_ids.shape
    if ids.shape != logprobs.shape or ids.shape[:2] != (rows, length):
        raise ConfigError(f"ids {ids.shape}, log-probs {logprobs.shape} and tokens {input_ids.shape} disagree")
    if ids.shape[2] < settings.k:
        raise ConfigError(f"the compressor settings store k={settings.k} log-probs per position; the targets "
                          f"hold K={ids.shape[2]}")
    if (ids >= 2 ** settings.index_bits).any() or (input_ids >= settings.d).any():
        raise ConfigError(f"ids reach past the compressor settings' vocabulary d={settings.d}")
    order = np.argsort(-logprobs, axis=2, kind="stable")[..., :settings.k]
    ids = np.take_along_axis(ids, order, 2).reshape(-1, settings.k)
    logprobs = np.take_along_axis(logprobs, order, 2).reshape(-1, settings.k)
    targeted = np.ones(rows * length, bool) if target is None else np.asarray(target, bool).reshape(-1)
    placeholder = -np.log(settings.k) - np.arange(settings.k) * 1e-3  # distinct ids, finite and descending
    ids[~targeted], logprobs[~targeted] = np.arange(settings.k), placeholder
    _check_writable(ids, logprobs, settings, length)
    ids[ids < 0] = 0  # an empty slot (log-prob -inf) has no id; DistillKit gathers it with weight 0
    columns: dict[str, Any] = {
        TOKENS: pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * length),
                                         pa.array(input_ids.reshape(-1).astype(np.uint64))),
        LOGPROBS: _nested(encode_logprobs(logprobs, settings), length, pa.uint8()),
        INDICES: _nested(pack_bits(ids.astype(np.uint64), settings.index_bits), length, pa.uint8())}
    if target is not None:
        labels = np.where(targeted.reshape(rows, length), input_ids, IGNORE_LABEL).reshape(-1)
        columns[LABELS] = pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * length),
                                                   pa.array(labels))
    return pa.table(columns)


def _check_writable(ids: np.ndarray, logprobs: np.ndarray, settings: DistillKitSettings, length: int) -> None:
    """Empty slots (-inf) survive only as exact floats without deltas: a curve or a difference through -inf is
    not a number. Any other settings need every stored position to hold k real log-probs."""
    empty = np.isneginf(logprobs)
    not_numbers = np.flatnonzero((np.isnan(logprobs) | (logprobs == np.inf)).any(axis=1))
    if len(not_numbers):
        position = int(not_numbers[0])
        raise StoreError(f"row {position // length} field {LOGPROBS}: log-probs that are not numbers at position "
                         f"{position % length}")
    if empty.any() and (settings.delta_encoding or settings.approx_k):
        position = int(np.flatnonzero(empty.any(axis=1))[0])
        raise StoreError(f"row {position // length} field {LOGPROBS}: position {position % length} holds fewer "
                         f"than k={settings.k} log-probs, which only exact settings without delta_encoding store")
