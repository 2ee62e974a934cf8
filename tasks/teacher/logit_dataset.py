"""A top-K logit dataset's record batches (read by kdflow.tasks.teacher.logit_reader) mapped by a declared layout
(kdflow.schemas.logit_layouts) and checked. Every problem is one line naming the row and the field (a `StoreError`),
found before the importer makes anything visible.

`source_rows` maps a batch of rows of any length to SourceRows (masks applied, values of any kind turned into
log-probs), vectorised over the batch's positions (reading in source_columns, value checks in source_values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from kdflow.schemas.errors import StoreError
from kdflow.schemas.logit_layouts import LAYOUTS, LogitLayout
from kdflow.tasks.teacher.distillkit import is_distillkit
from kdflow.tasks.teacher.source_columns import (any_per_position, entries_per_position, fail_at, list_depth, nested,
                                                 same_rows)
from kdflow.tasks.teacher.source_rows import SourceRows
from kdflow.tasks.teacher.source_values import (log_probs, outside_vocabulary, pair_order_hint, probabilities_to_log,
                                                whole_ids)


_VALUES = {"logits": "logits", "probabilities": "probabilities"}  # what the values are, in messages


def _missing(table: pa.Table | pa.RecordBatch, layout: LogitLayout) -> str | None:
    """The first of the layout's columns the source lacks. The tail and the text may be absent (the tail is then
    1 - sum p, the text unchecked), and so may a built-in's masks, as older kdflow exports lack them; the masks of a
    declared layout change what is trained on, so a name that the source lacks is an error, not ignored."""
    masks = tuple(c for c in (layout.target_mask, layout.attention_mask) if c is not None)
    wanted = layout.required() if LAYOUTS.get(layout.name) == layout else (*layout.required(), *masks)
    return next((name for name in wanted if name not in table.schema.names), None)


def check_columns(table: pa.Table | pa.RecordBatch, layout: LogitLayout, path: str,
                  all_columns: Callable[[], list[str]] | None = None) -> None:
    """`table`: the columns read; `all_columns`: the source's own, for the message (a read takes the layout's
    columns only)."""
    missing = _missing(table, layout)
    if missing is not None:
        columns = all_columns() if all_columns is not None else table.schema.names
        hint = "; it looks like a DistillKit capture: --layout distillkit" if is_distillkit(list(columns)) else ""
        raise StoreError(f"import source {path!r} has no column {missing!r} of layout {layout.name} "
                         f"(columns: {', '.join(columns)}){hint}")


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
    return _mask_column(batch, field, layout, first_row, row_lengths, 0)[0]


def _mask_column(batch: pa.RecordBatch | pa.Table, field: str | None, layout: LogitLayout, first_row: int,
                 row_lengths: np.ndarray, k: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(per-position values (N,), per-entry mask (N, K) bool or None): a `[T][K]` target mask of K entries at every
    position masks entries one by one (as axolotl's loss reads it), any other shape whole positions."""
    if field is None or field not in batch.schema.names:
        return None, None
    depth = 2 if field == layout.target_mask and list_depth(batch.schema.field(field).type) == 2 else 1
    values, lengths = nested(batch.column(field), field, first_row, ("position", "entry")[:depth])
    same_rows(first_row, field, lengths[0], layout.tokens, row_lengths)
    if depth == 1:
        return values, None
    entries = values.reshape(-1, k) != 0 if k and len(lengths[1]) and bool((lengths[1] == k).all()) else None
    return any_per_position(values, lengths), entries


def source_rows(batch: pa.RecordBatch | pa.Table, layout: LogitLayout, first_row: int, top_k: int,
                vocab_size: int) -> SourceRows:
    """Rows of any length mapped by `layout` to canonical SourceRows and checked, before anything is written.

    Positions with attention mask 0 are dropped; positions with target mask 0, or whose values are all -inf (how
    axolotl pads prompts), keep their token but get no target. Values become log-probs by `layout.kind`: logprobs
    stay (normalisation full), probabilities become their log (full too), renormalised must sum to 1 over the K,
    logits get a log-softmax over the K (both normalisation top_k). A `[T][K]` target mask drops entries one by
    one. Each problem is one StoreError line naming the source row, the field and the position."""
    missing = _missing(batch, layout)
    if missing is not None:
        raise StoreError(f"row {first_row}: no column {missing!r} of layout {layout.name} "
                         f"(columns: {', '.join(batch.schema.names)})")
    tokens_raw, (row_lengths,) = nested(batch.column(layout.tokens), layout.tokens, first_row, ("position",))
    ids_field, values_field, ids_raw, values = _targets(batch, layout, first_row, row_lengths, top_k)
    attention = _position_column(batch, layout.attention_mask, layout, first_row, row_lengths)
    keep = np.ones(len(tokens_raw), bool) if attention is None else attention != 0
    mask, entries = _mask_column(batch, layout.target_mask, layout, first_row, row_lengths, values.shape[1])
    target = keep.copy() if mask is None else keep & (mask != 0)
    if entries is not None and not entries[target].all():  # masked entries: padding, after the kept ones
        order = np.argsort(~entries, axis=1, kind="stable")
        pad = 0.0 if layout.kind == "probabilities" else -np.inf
        values = np.where(np.take_along_axis(entries, order, 1), np.take_along_axis(values, order, 1), pad)
        ids_raw = np.take_along_axis(ids_raw, order, 1)

    def fail(hits: np.ndarray, field: str, problem: str) -> None:
        fail_at(first_row, row_lengths, hits, field, problem)

    fail(target & np.isnan(values).any(1), values_field, "a value that is not a number")
    if layout.kind == "probabilities":  # their log from here on: 0 pads as -inf does
        values = probabilities_to_log(values, first_row, row_lengths, values_field, target[:, None])
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
             f"{_VALUES.get(layout.kind, 'log-probs')} not sorted by descending value")
    tail = _position_column(batch, layout.tail, layout, first_row, row_lengths) if layout.has_tail_kind else None
    if tail is not None and layout.kind == "probabilities":  # the mass outside the K, as a probability
        tail = probabilities_to_log(tail.astype(np.float64), first_row, row_lengths, layout.tail, target)
    logprobs, normalisation, tail = log_probs(layout, values, real, target, tail, first_row, row_lengths)
    rows = np.repeat(np.arange(len(row_lengths)), row_lengths)
    offsets = np.concatenate(([0], np.cumsum(np.bincount(rows[keep], minlength=len(row_lengths))))).astype(np.int64)
    text = batch.column(layout.text).to_pylist() if layout.text and layout.text in batch.schema.names else None
    return SourceRows(first_row=first_row, offsets=offsets, tokens=tokens[keep].astype(np.int32),
                      ids=ids[keep].astype(np.int32), logprobs=logprobs[keep].astype(np.float32), target=target[keep],
                      tail=None if tail is None else tail[keep], text=text, normalisation=normalisation)


def check_text(rows: SourceRows, tokenizer: Any, start: int, layout: LogitLayout) -> None:
    """Where the source holds the text: the tokenizer's encoding of it must begin with the row's token ids."""
    if rows.text is None:
        return
    for offset, (text, ids) in enumerate(zip(rows.text, np.split(rows.tokens, rows.offsets[1:-1]))):
        encoded = np.asarray(tokenizer(text or "", add_special_tokens=False)["input_ids"][:len(ids)], np.int64)
        if len(encoded) < len(ids) or not np.array_equal(encoded, ids):
            differ = np.flatnonzero(encoded[:len(ids)] != ids[:len(encoded)])
            at = int(differ[0]) if len(differ) else min(len(encoded), len(ids))
            raise StoreError(f"row {start + offset} field {layout.text}: the tokenizer's encoding differs from "
                             f"{layout.tokens} at position {at}")


