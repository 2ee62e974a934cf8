"""The value checks of an import source's rows, vectorised over all positions of a batch: ids (stored as integers
or as whole floats) inside the vocabulary, and values of a layout's kind turned into log-probs
(kdflow.tasks.teacher.logit_dataset.source_rows calls these after reading the columns flat).

Arrays are `(N, K)` over the batch's positions; `real` marks the entries that count (a position with a target, an
entry that is not -inf padding); `target` marks the positions with a target.
"""

from __future__ import annotations

import numpy as np

from kdflow.schemas.errors import StoreError
from kdflow.schemas.logit_layouts import LogitLayout
from kdflow.tasks.teacher.source_columns import fail_at, first_position
from kdflow.tasks.teacher.source_rows import FULL, TOP_K

# Log-probs rounded to float16 by their writer can sum a little above 1 (each p is off by ~p * |log p| * 2^-11);
# a source whose kept mass exceeds 1 by more than this is wrong, not rounded. Renormalised values must sum to 1
# within the same margin.
MASS_TOLERANCE = 5e-3


def _per_position(hits: np.ndarray) -> np.ndarray:
    """(N,) or (N, K) -> (N,): whether each position has a hit."""
    return hits if hits.ndim == 1 else hits.any(axis=1)


def whole_ids(values: np.ndarray, real: np.ndarray, first_row: int, row_lengths: np.ndarray, field: str
              ) -> np.ndarray:
    """Ids stored as integers or floats -> int64 (-1 outside `real`); a float that is not a whole number where it
    counts is a StoreError."""
    if values.dtype.kind not in "iuf":
        raise StoreError(f"row {first_row} field {field}: ids of type {values.dtype}, not numbers")
    if values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = real & ~(np.isfinite(values) & (values == np.round(values)))
        fail_at(first_row, row_lengths, _per_position(bad), field, "ids that are not whole numbers")
    return np.where(real, values, -1).astype(np.int64)


def outside_vocabulary(ids: np.ndarray, real: np.ndarray, vocab_size: int, first_row: int, row_lengths: np.ndarray,
                       field: str, name: str) -> None:
    bad = real & ((ids < 0) | (ids >= vocab_size))
    hit = first_position(first_row, row_lengths, _per_position(bad))
    if hit is not None:
        position = int(np.flatnonzero(_per_position(bad))[0])
        value = np.atleast_1d(ids[position])[np.atleast_1d(bad[position])][0]
        raise StoreError(f"row {hit[0]} field {field}: {name} {value} at position {hit[1]} is outside the "
                         f"vocabulary of {vocab_size}")


def pair_order_hint(layout: LogitLayout, values: np.ndarray, real: np.ndarray) -> str:
    """For a stacked column whose ids are not whole numbers while its values all are: the pair is the other way
    round (the cause to name, rather than 'ids that are not whole numbers' alone)."""
    if layout.stacked is None:
        return ""
    with np.errstate(invalid="ignore"):
        whole = bool(np.all((values == np.round(values)) | ~real))
    flipped = "values_first" if layout.stacked_order == "ids_first" else "ids_first"
    return (f": the pair order is probably reversed (layout {layout.name} reads {layout.stacked_order}; declare "
            f"stacked_order: {flipped}, or --stacked-order {flipped})" if whole else "")


def _all_like_probabilities(values: np.ndarray, real: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(N,) bool: positions with a target whose kept values (two or more) all lie in [0, 1] and sum to at most 1,
    where every position with a target of the batch does (one such position of logits is chance; a batch of them
    is not)."""
    with np.errstate(invalid="ignore"):
        inside = ~real | ((values >= 0) & (values <= 1))
    like = target & inside.all(1) & (np.where(real, values, 0.0).sum(1) <= 1 + MASS_TOLERANCE) & (real.sum(1) > 1)
    return like if target.any() and bool(like[target].all()) else np.zeros_like(target)


def _like_probabilities(values: np.ndarray, real: np.ndarray, target: np.ndarray) -> bool:
    return bool(_all_like_probabilities(values, real, target).any())


def probabilities_to_log(values: np.ndarray, first_row: int, row_lengths: np.ndarray, field: str,
                         counted: np.ndarray) -> np.ndarray:
    """Values of kind probabilities -> their log (0 becomes -inf, padding); one outside [0, 1] where it counts
    (`counted`, (N,) or (N, K)) is a StoreError."""
    with np.errstate(invalid="ignore"):
        bad = counted & ~((values >= 0) & (values <= 1))
    fail_at(first_row, row_lengths, _per_position(bad), field, "a probability outside [0, 1]")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(values)


def log_probs(layout: LogitLayout, values: np.ndarray, real: np.ndarray, target: np.ndarray, tail: np.ndarray | None,
              first_row: int, row_lengths: np.ndarray) -> tuple[np.ndarray, str, np.ndarray | None]:
    """(N, K) values of `layout.kind` -> (log-probs float64, -inf outside `real`; normalisation; tail float32
    (N,) or None). `tail`: the source's tail column, read only for kind logprobs."""
    field = layout.stacked or layout.values
    if layout.kind == "logits":  # log-softmax over the K kept, in float64 (several captures store float64 logits)
        fail_at(first_row, row_lengths, _all_like_probabilities(values, real, target), field,
                "probabilities declared as logits (every value in [0, 1], summing to at most 1)",
                ": declare kind probabilities")
        top = np.where(target, values[:, 0], 0.0)[:, None]  # sorted descending: the first entry is the largest
        with np.errstate(invalid="ignore", divide="ignore"):  # positions without a target: log(0), set to -inf
            shifted = np.where(real, values - top, -np.inf)
            return np.where(real, shifted - np.log(np.exp(shifted).sum(1, keepdims=True)), -np.inf), TOP_K, None
    with np.errstate(invalid="ignore", over="ignore"):
        mass = np.where(real, np.exp(values), 0.0).sum(1)
    if layout.kind == "renormalised":
        off = target & (np.abs(mass - 1.0) > MASS_TOLERANCE)
        hit = first_position(first_row, row_lengths, off)
        if hit is not None:
            kind = "probabilities" if _like_probabilities(values, real, target) else "logprobs"
            raise StoreError(f"row {hit[0]} field {field}: values sum to {mass[np.flatnonzero(off)[0]]:.3g}, not 1, "
                             f"at position {hit[1]}: declare kind {kind}")
        return np.where(real, values, -np.inf), TOP_K, None
    above = target & (mass > 1 + MASS_TOLERANCE)
    logits = bool((above[:, None] & real & (values > 0)).any())
    hint = (": values in [0, 1] that sum to at most 1 look like probabilities, declare kind probabilities"
            if _like_probabilities(values, real, target) else
            ": values above 0 look like logits, declare kind logits" if logits else "")
    fail_at(first_row, row_lengths, above, field, "log-probs whose probabilities sum above 1", hint)
    if tail is not None:
        tail = tail.astype(np.float64)
        fail_at(first_row, row_lengths, target & np.isnan(tail), layout.tail, "a tail log-mass that is NaN")
        fail_at(first_row, row_lengths, target & (tail > MASS_TOLERANCE), layout.tail, "a tail log-mass above 0")
        tail = np.where(target, np.minimum(tail, 0.0), -np.inf).astype(np.float32)
    return np.where(real, values, -np.inf), FULL, tail
