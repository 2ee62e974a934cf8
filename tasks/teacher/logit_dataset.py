"""A top-K logit dataset's record batches (read by kdflow.tasks.teacher.logit_reader) mapped by a declared layout
(kdflow.schemas.logit_layouts) to the arrays of a top-K store and checked row by row. Every problem is one line
naming the row and the field (a `StoreError`), found before the importer writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kdflow.schemas.errors import StoreError
from kdflow.schemas.logit_layouts import LogitLayout

# Log-probs rounded to float16 by their writer can sum a little above 1 (each p is off by ~p * |log p| * 2^-11);
# a source whose kept mass exceeds 1 by more than this is wrong, not rounded.
MASS_TOLERANCE = 5e-3


@dataclass
class LogitRows:
    """Rows [start, stop) of a source, as a top-K store holds them."""

    input_ids: np.ndarray  # (n, T) int32
    ids: np.ndarray  # (n, T, K) int32
    logprobs: np.ndarray  # (n, T, K) float32
    tail: np.ndarray | None  # (n, T) float32, or None when the source has none
    text: list[str] | None


def check_columns(table: pa.Table, layout: LogitLayout, path: str) -> None:
    missing = [name for name in layout.required() if name not in table.column_names]
    if missing:
        raise StoreError(f"import source {path!r} has no column {missing[0]!r} of layout {layout.name} "
                         f"(columns: {', '.join(table.column_names)})")


def _dense(column: pa.ChunkedArray, start: int, field: str, sizes: list[int | None], what: list[str]) -> np.ndarray:
    """A nested list column of rows [start, ...) -> one numpy array; ragged or wrong sizes name row and field.

    `sizes`: the wanted length of each nesting level (None: whatever the first entry has, the same for all)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    shape, per_row = [len(array)], 1  # per_row: entries of the current level per source row
    for level, (size, name) in enumerate(zip(sizes, what)):
        if array.null_count:
            index = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
            raise StoreError(f"row {start + index // per_row} field {field}: a null {name} list")
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
                or pa.types.is_fixed_size_list(array.type)):
            raise StoreError(f"row {start} field {field}: not a list of {name}s (type {column.type})")
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        expected = size if size is not None else (int(lengths[0]) if len(lengths) else 0)
        wrong = np.flatnonzero(lengths != expected)
        if len(wrong):
            index = int(wrong[0])
            row = start + index // per_row
            if level == 0:
                raise StoreError(f"row {row} field {field}: {lengths[index]} {name}s, the config's seq_len is "
                                 f"{expected}")
            position = index % per_row // (per_row // shape[1])
            kind = "ragged K: " if size is None else ""
            raise StoreError(f"row {row} field {field}: {kind}position {position} has {lengths[index]} {name}s, "
                             f"{'others' if size is None else 'expected'} {expected}")
        shape.append(expected)
        per_row *= expected
        array = array.flatten()
    if array.null_count:
        index = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise StoreError(f"row {start + index // per_row} field {field}: a null value")
    return array.to_numpy(zero_copy_only=False).reshape(shape)


def _integers(values: np.ndarray, start: int, field: str) -> np.ndarray:
    if values.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(values.reshape(len(values), -1)).all(1)
                             | (values != np.round(values)).reshape(len(values), -1).any(1))
        if len(bad):
            raise StoreError(f"row {start + int(bad[0])} field {field}: ids that are not whole numbers")
    elif values.dtype.kind not in "iu":
        raise StoreError(f"row {start} field {field}: ids of type {values.dtype}, not integers")
    return values.astype(np.int64)


def _first(mask: np.ndarray) -> tuple[int, int] | None:
    """(row, position) of the first True of a (n, T, ...) mask, or None."""
    flat = mask.reshape(mask.shape[0], mask.shape[1], -1).any(-1)
    hits = np.argwhere(flat)
    return (int(hits[0][0]), int(hits[0][1])) if len(hits) else None


def logit_rows(table: pa.Table, layout: LogitLayout, start: int, stop: int, seq_len: int, top_k: int,
                vocab_size: int) -> LogitRows:
    """Rows [start, stop) mapped and checked: lengths, K, ids in the vocabulary and distinct per position,
    log-probs finite, sorted descending and summing to at most 1, tail at most 0."""
    rows = table.slice(start, stop - start)
    tokens = _integers(_dense(rows.column(layout.tokens), start, layout.tokens, [seq_len], ["position"]), start,
                       layout.tokens)
    if layout.stacked is not None:
        stacked = _dense(rows.column(layout.stacked), start, layout.stacked, [seq_len, 2, None],
                         ["position", "pair", "entry"])
        ids_field = lp_field = layout.stacked
        ids, logprobs = _integers(stacked[:, :, 0], start, ids_field), stacked[:, :, 1]
    else:
        ids_field, lp_field = layout.ids, layout.values
        ids = _integers(_dense(rows.column(ids_field), start, ids_field, [seq_len, None], ["position", "id"]),
                        start, ids_field)
        logprobs = _dense(rows.column(lp_field), start, lp_field, [seq_len, None], ["position", "log-prob"])
        if logprobs.shape != ids.shape:
            raise StoreError(f"row {start} field {lp_field}: K={logprobs.shape[-1]}, {ids_field} has "
                             f"K={ids.shape[-1]}")
    if ids.shape[-1] != top_k:
        raise StoreError(f"row {start} field {ids_field}: K={ids.shape[-1]}, the config's precompute.top_k is "
                         f"{top_k}; set precompute.top_k: {ids.shape[-1]}")
    for field, values, name in ((layout.tokens, tokens, "token id"), (ids_field, ids, "id")):
        hit = _first((values < 0) | (values >= vocab_size))
        if hit is not None:
            value = values[hit][(values[hit] < 0) | (values[hit] >= vocab_size)].ravel()[0]
            raise StoreError(f"row {start + hit[0]} field {field}: {name} {value} at position {hit[1]} is outside "
                             f"the vocabulary of {vocab_size}")
    ordered = np.sort(ids, axis=-1)
    hit = _first(ordered[..., 1:] == ordered[..., :-1])
    if hit is not None:
        raise StoreError(f"row {start + hit[0]} field {ids_field}: position {hit[1]} repeats an id")
    logprobs = logprobs.astype(np.float64)
    for problem, mask in (("a log-prob that is not finite", ~np.isfinite(logprobs)),
                          ("log-probs not sorted by descending value", np.diff(logprobs, axis=-1) > 0),
                          ("log-probs whose probabilities sum above 1",
                           (np.exp(logprobs).sum(-1) > 1 + MASS_TOLERANCE)[..., None])):
        hit = _first(mask)
        if hit is not None:
            raise StoreError(f"row {start + hit[0]} field {lp_field}: {problem} at position {hit[1]}")
    tail = None
    if layout.tail is not None and layout.tail in table.column_names:
        tail = _dense(rows.column(layout.tail), start, layout.tail, [seq_len], ["position"]).astype(np.float64)
        hit = _first(((tail > MASS_TOLERANCE) | np.isnan(tail))[..., None])
        if hit is not None:
            raise StoreError(f"row {start + hit[0]} field {layout.tail}: a tail log-mass above 0 at position {hit[1]}")
        tail = np.minimum(tail, 0.0).astype(np.float32)
    text = rows.column(layout.text).to_pylist() if layout.text and layout.text in table.column_names else None
    return LogitRows(tokens.astype(np.int32), ids.astype(np.int32), logprobs.astype(np.float32), tail, text)


def computed_tail(logprobs: np.ndarray) -> np.ndarray:
    """(n, T, K) -> (n, T) float32: log(1 - sum p) in float64, clamped to [0, 1] (-inf where nothing is left)."""
    mass = np.exp(np.asarray(logprobs, dtype=np.float64)).sum(-1)
    with np.errstate(divide="ignore"):
        return np.log(np.clip(1.0 - mass, 0.0, 1.0)).astype(np.float32)


# --- TEMPORARY ADAPTER (issue 45, part "stream"): replaced at the merge by the "layouts" part's real
# `kdflow.tasks.teacher.source_rows.source_rows`, which reads rows of any length, masks and every layout kind. It
# maps each run of equal-length rows of a batch through `logit_rows` (seq_len = that run's row length), so that the
# streaming importer can be built and tested on rows of varying length before then.
def source_rows(batch: pa.RecordBatch, layout: LogitLayout, first_row: int, top_k: int, vocab_size: int) -> Any:
    from kdflow.tasks.teacher.source_rows import SourceRows

    table = pa.Table.from_batches([batch])
    check_columns(table, layout, "the source")
    lengths = pc.list_value_length(table.column(layout.tokens)).to_numpy(zero_copy_only=False).astype(np.int64)
    cuts = [0, *(np.flatnonzero(np.diff(lengths)) + 1).tolist(), len(lengths)]
    parts, texts = [], []
    for start, stop in zip(cuts[:-1], cuts[1:]):
        try:
            rows = logit_rows(table, layout, start, stop, int(lengths[start]), top_k, vocab_size)
        except StoreError as error:  # logit_rows counts rows from the batch's first: name the source's row
            words = str(error).split(" ", 2)
            if words[0] != "row" or not words[1].isdigit():
                raise
            raise StoreError(f"row {first_row + int(words[1])} {words[2]}") from None
        parts.append(rows)
        texts.extend(rows.text or [])
    n = int(lengths.sum())

    def flat(name: str, *shape: int) -> np.ndarray:
        return np.concatenate([getattr(p, name).reshape(-1, *shape) for p in parts]) if parts else np.zeros(
            (0, *shape), np.float32)

    has_tail = bool(parts) and parts[0].tail is not None
    return SourceRows(first_row=first_row, offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                      tokens=flat("input_ids").astype(np.int32), ids=flat("ids", top_k).astype(np.int32),
                      logprobs=flat("logprobs", top_k).astype(np.float32), target=np.ones(n, dtype=bool),
                      tail=flat("tail") if has_tail else None,
                      text=texts if parts and parts[0].text is not None else None)
