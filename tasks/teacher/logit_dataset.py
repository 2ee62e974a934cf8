"""A top-K logit dataset read for import: a local Hugging Face dataset folder (`datasets.load_from_disk`), Parquet
files or JSON lines, mapped by a declared layout (kdflow.schemas.logit_layouts) and checked. Every problem is one
line naming the row and the field (a `StoreError`), found before the importer writes anything.

`source_rows` maps a batch of rows of any length to SourceRows (masks applied, values of any kind turned into
log-probs), vectorised over the batch's positions (reading in source_columns, value checks in source_values).
`logit_rows` is the fixed-length reader the importer used before; it goes once the importer reads SourceRows.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.logit_layouts import LAYOUTS, LogitLayout
from kdflow.tasks.common.saved_datasets import is_saved_dataset, load_saved_dataset
from kdflow.tasks.teacher.source_columns import (any_per_position, entries_per_position, fail_at, list_depth, nested,
                                                 same_rows)
from kdflow.tasks.teacher.source_rows import SourceRows
from kdflow.tasks.teacher.source_values import (MASS_TOLERANCE, log_probs, outside_vocabulary, pair_order_hint,
                                                whole_ids)



@dataclass
class LogitRows:
    """Rows [start, stop) of a source, as a top-K store holds them."""

    input_ids: np.ndarray  # (n, T) int32
    ids: np.ndarray  # (n, T, K) int32
    logprobs: np.ndarray  # (n, T, K) float32
    tail: np.ndarray | None  # (n, T) float32, or None when the source has none
    text: list[str] | None


def read_logit_dataset(path: str) -> pa.Table:
    """The whole source as one Arrow table (memory-mapped where the format allows)."""
    if not os.path.exists(path):
        raise ConfigError(f"import source {path!r} does not exist")
    try:
        if is_saved_dataset(path):
            data = load_saved_dataset(path)
            if data._indices is not None:
                data = data.flatten_indices()
            return data.data.table
        files = ([os.path.join(root, name) for root, _, names in sorted(os.walk(path)) for name in sorted(names)]
                 if os.path.isdir(path) else [path])
        parquet = [f for f in files if f.endswith(".parquet")]
        jsonl = [f for f in files if f.endswith((".jsonl", ".json"))]
        if parquet:
            import pyarrow.parquet as pq

            return pa.concat_tables([pq.read_table(f) for f in parquet])
        if jsonl:
            import pyarrow.json as pj

            return pa.concat_tables([pj.read_json(f) for f in jsonl])
    except (OSError, ValueError, pa.ArrowInvalid) as error:
        raise StoreError(f"cannot read import source {path!r}: {str(error).splitlines()[0]}") from None
    raise ConfigError(f"import source {path!r} is no dataset folder, Parquet or JSON lines file")


def _builtin(layout: LogitLayout) -> bool:
    return LAYOUTS.get(layout.name) == layout


def _missing(table: pa.Table | pa.RecordBatch, layout: LogitLayout) -> str | None:
    """The first of the layout's columns the source lacks. The tail and the text may be absent (the tail is then
    1 - sum p, the text unchecked), and so may a built-in's masks, as older kdflow exports lack them; the masks of a
    declared layout change what is trained on, so a name that the source lacks is an error, not ignored."""
    masks = tuple(c for c in (layout.target_mask, layout.attention_mask) if c is not None)
    wanted = layout.required() if LAYOUTS.get(layout.name) == layout else (*layout.required(), *masks)
    return next((name for name in wanted if name not in table.schema.names), None)


def check_columns(table: pa.Table | pa.RecordBatch, layout: LogitLayout, path: str) -> None:
    missing = _missing(table, layout)
    if missing is not None:
        raise StoreError(f"import source {path!r} has no column {missing!r} of layout {layout.name} "
                         f"(columns: {', '.join(table.schema.names)})")


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
        ids_at = 0 if layout.stacked_order == "ids_first" else 1
        ids, logprobs = _integers(stacked[:, :, ids_at], start, ids_field), stacked[:, :, 1 - ids_at]
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


def _targets(batch: pa.RecordBatch | pa.Table, layout: LogitLayout, first_row: int, row_lengths: np.ndarray,
             top_k: int) -> tuple[str, str, np.ndarray, np.ndarray]:
    """(ids field, values field, raw ids (N, K), values (N, K) float64) in the declared pair order."""
    n = int(row_lengths.sum())
    if layout.stacked is not None:
        field = layout.stacked
        flat, lengths = nested(batch.column(field), field, first_row, ("position", "pair", "entry"))
        same_rows(first_row, field, lengths[0], layout.tokens, row_lengths)
        fail_at(first_row, row_lengths, lengths[1] != 2, field, "not a pair of lists (ids and values)")
        k = entries_per_position(first_row, field, lengths, top_k, "entry")
        grid = flat.reshape(n, 2, k)
        ids_at = 0 if layout.stacked_order == "ids_first" else 1
        return field, field, grid[:, ids_at], grid[:, 1 - ids_at].astype(np.float64)
    ids_flat, ids_lengths = nested(batch.column(layout.ids), layout.ids, first_row, ("position", "id"))
    same_rows(first_row, layout.ids, ids_lengths[0], layout.tokens, row_lengths)
    k = entries_per_position(first_row, layout.ids, ids_lengths, top_k, "id")
    values, lengths = nested(batch.column(layout.values), layout.values, first_row, ("position", "value"))
    same_rows(first_row, layout.values, lengths[0], layout.tokens, row_lengths)
    fail_at(first_row, row_lengths, lengths[1] != ids_lengths[1], layout.values, "another number of values than ids",
            f" ({layout.ids} has K={k})")
    return layout.ids, layout.values, ids_flat.reshape(n, k), values.reshape(n, k).astype(np.float64)


def _position_column(batch: pa.RecordBatch | pa.Table, field: str | None, layout: LogitLayout, first_row: int,
                     row_lengths: np.ndarray) -> np.ndarray | None:
    """A per-position column (`[T]`, or `[T][K]` for a mask) as (N,) values, or None where absent."""
    if field is None or field not in batch.schema.names:
        return None
    depth = 2 if field == layout.target_mask and list_depth(batch.schema.field(field).type) == 2 else 1
    values, lengths = nested(batch.column(field), field, first_row, ("position", "entry")[:depth])
    same_rows(first_row, field, lengths[0], layout.tokens, row_lengths)
    return any_per_position(values, lengths) if depth == 2 else values


def source_rows(batch: pa.RecordBatch | pa.Table, layout: LogitLayout, first_row: int, top_k: int,
                vocab_size: int) -> SourceRows:
    """Rows of any length mapped by `layout` to canonical SourceRows and checked, before anything is written.

    Positions with attention mask 0 are dropped; positions with target mask 0, or whose values are all -inf (how
    axolotl pads prompts), keep their token but get no target. Values become log-probs by `layout.kind`: logprobs
    stay (normalisation full), renormalised must sum to 1 over the K, logits get a log-softmax over the K (both
    normalisation top_k). Each problem is one StoreError line naming the source row, the field and the position."""
    missing = _missing(batch, layout)
    if missing is not None:
        raise StoreError(f"row {first_row}: no column {missing!r} of layout {layout.name} "
                         f"(columns: {', '.join(batch.schema.names)})")
    tokens_raw, (row_lengths,) = nested(batch.column(layout.tokens), layout.tokens, first_row, ("position",))
    ids_field, values_field, ids_raw, values = _targets(batch, layout, first_row, row_lengths, top_k)
    attention = _position_column(batch, layout.attention_mask, layout, first_row, row_lengths)
    keep = np.ones(len(tokens_raw), bool) if attention is None else attention != 0
    mask = _position_column(batch, layout.target_mask, layout, first_row, row_lengths)
    target = keep.copy() if mask is None else keep & (mask != 0)

    def fail(hits: np.ndarray, field: str, problem: str) -> None:
        fail_at(first_row, row_lengths, hits, field, problem)

    fail(target & np.isnan(values).any(1), values_field, "a value that is not a number")
    padding = values == -np.inf
    target &= ~padding.all(1)
    fail(target & (values == np.inf).any(1), values_field, "a value of +inf")
    fail(target & (padding[:, :-1] & ~padding[:, 1:]).any(1), values_field,
         "-inf before a finite value (-inf may only pad the end of a position)")
    real = target[:, None] & ~padding
    tokens = whole_ids(tokens_raw, keep, first_row, row_lengths, layout.tokens)
    outside_vocabulary(tokens, keep, vocab_size, first_row, row_lengths, layout.tokens, "token id")
    try:
        ids = whole_ids(ids_raw, real, first_row, row_lengths, ids_field)
    except StoreError as error:  # name the likelier cause where the pair looks the other way round
        raise StoreError(f"{error}{pair_order_hint(layout, values, real)}") from None
    outside_vocabulary(ids, real, vocab_size, first_row, row_lengths, ids_field, "id")
    distinct = np.sort(np.where(real, ids, -2 - np.arange(ids.shape[1])), axis=1)
    fail(target & (distinct[:, 1:] == distinct[:, :-1]).any(1), ids_field, "a repeated id")
    with np.errstate(invalid="ignore"):
        fail(target & ((np.diff(values, axis=1) > 0) & real[:, 1:]).any(1), values_field,
             f"{'logits' if layout.kind == 'logits' else 'log-probs'} not sorted by descending value")
    tail = _position_column(batch, layout.tail, layout, first_row, row_lengths) if layout.kind == "logprobs" else None
    logprobs, normalisation, tail = log_probs(layout, values, real, target, tail, first_row, row_lengths)
    rows = np.repeat(np.arange(len(row_lengths)), row_lengths)
    offsets = np.concatenate(([0], np.cumsum(np.bincount(rows[keep], minlength=len(row_lengths))))).astype(np.int64)
    text = batch.column(layout.text).to_pylist() if layout.text and layout.text in batch.schema.names else None
    return SourceRows(first_row=first_row, offsets=offsets, tokens=tokens[keep].astype(np.int32),
                      ids=ids[keep].astype(np.int32), logprobs=logprobs[keep].astype(np.float32), target=target[keep],
                      tail=None if tail is None else tail[keep], text=text, normalisation=normalisation)


def computed_tail(logprobs: np.ndarray) -> np.ndarray:
    """(n, T, K) -> (n, T) float32: log(1 - sum p) in float64, clamped to [0, 1] (-inf where nothing is left)."""
    mass = np.exp(np.asarray(logprobs, dtype=np.float64)).sum(-1)
    with np.errstate(divide="ignore"):
        return np.log(np.clip(1.0 - mass, 0.0, 1.0)).astype(np.float32)


def check_text(rows: LogitRows | SourceRows, tokenizer: Any, start: int, layout: LogitLayout) -> None:
    """Where the source holds the text: the tokenizer's encoding of it must begin with the row's token ids."""
    if rows.text is None:
        return
    token_rows = (np.split(rows.tokens, rows.offsets[1:-1]) if isinstance(rows, SourceRows) else rows.input_ids)
    for offset, (text, ids) in enumerate(zip(rows.text, token_rows)):
        encoded = np.asarray(tokenizer(text or "", add_special_tokens=False)["input_ids"][:len(ids)], np.int64)
        if len(encoded) < len(ids) or not np.array_equal(encoded, ids):
            differ = np.flatnonzero(encoded[:len(ids)] != ids[:len(encoded)])
            at = int(differ[0]) if len(differ) else min(len(encoded), len(ids))
            raise StoreError(f"row {start + offset} field {layout.text}: the tokenizer's encoding differs from "
                             f"{layout.tokens} at position {at}")


def digest_rows(digest: Any, rows: LogitRows) -> None:
    """Fold the rows' arrays into `digest` (what the imported store's teacher fingerprint names)."""
    for array in (rows.input_ids, rows.ids, rows.logprobs, rows.tail):
        digest.update(b"none" if array is None else np.ascontiguousarray(array).tobytes())


def new_digest() -> Any:
    return hashlib.sha256()
