"""Nested list columns of an import source read as flat numpy arrays, with the source row and position of any
problem: what kdflow.tasks.teacher.logit_dataset.source_rows builds its checks on.

Sources hold billions of positions, so nothing here loops over rows or positions in Python: a column of `[T][K]`
lists becomes one `(N * K,)` array plus the lengths of each nesting level, and a problem found at a flat index is
traced back to its row and position through those lengths.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kdflow.schemas.errors import StoreError


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def list_depth(kind: pa.DataType) -> int:
    """How many list levels a column type nests (`list<list<int>>`: 2)."""
    depth = 0
    while _is_list(kind):
        kind, depth = kind.value_type, depth + 1
    return depth


def _parent(lengths: np.ndarray, index: int) -> int:
    """The entry of the level above that holds child `index`, given that level's entries' lengths."""
    return int(np.searchsorted(np.cumsum(lengths), index, side="right"))


def origin(lengths: list[np.ndarray], level: int, index: int) -> tuple[int, int | None]:
    """(row within the batch, position within the row) of entry `index` of nesting level `level` (0: rows,
    1: positions, 2 and deeper: entries of a position); the position is None for a row."""
    for up in range(level - 1, 0, -1):
        index = _parent(lengths[up], index)
    if level == 0:
        return index, None
    row = _parent(lengths[0], index)
    return row, index - (int(np.sum(lengths[0][:row])) if row else 0)


def nested(column: pa.Array | pa.ChunkedArray, field: str, first_row: int, names: tuple[str, ...]
           ) -> tuple[np.ndarray, list[np.ndarray]]:
    """A column of `len(names)` list levels -> (its leaf values flat, the lengths of each level's entries).
    A null list or value, or a column that nests less deeply, is a StoreError naming the row."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths: list[np.ndarray] = []
    for level, name in enumerate(names):
        if not _is_list(array.type):
            raise StoreError(f"row {first_row} field {field}: not a list of {name}s (type {column.type})")
        if array.null_count:
            index = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
            row, position = origin(lengths, level, index)
            where = "" if position is None else f" at position {position}"
            raise StoreError(f"row {first_row + row} field {field}: a null {name} list{where}")
        lengths.append(pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64))
        array = array.flatten()
    if array.null_count:
        index = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        row, position = origin(lengths, len(names), index)
        raise StoreError(f"row {first_row + row} field {field}: a null value at position {position}")
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type)):
        raise StoreError(f"row {first_row} field {field}: values of type {array.type}, not numbers")
    return array.to_numpy(zero_copy_only=False), lengths


def same_rows(first_row: int, field: str, row_lengths: np.ndarray, tokens_field: str,
              token_lengths: np.ndarray) -> None:
    """Every row of `field` has as many positions as the row's token ids."""
    wrong = np.flatnonzero(row_lengths != token_lengths)
    if len(wrong):
        row = int(wrong[0])
        raise StoreError(f"row {first_row + row} field {field}: {row_lengths[row]} positions, {tokens_field} has "
                         f"{token_lengths[row]}")


def entries_per_position(first_row: int, field: str, lengths: list[np.ndarray], top_k: int, name: str) -> int:
    """The K every position of the column holds (its innermost lists), which must be the config's top_k."""
    inner = lengths[-1]
    if not len(inner):
        return top_k
    expected = int(inner[0])
    wrong = np.flatnonzero(inner != expected)
    if len(wrong):
        index = int(wrong[0])
        row, position = origin(lengths, len(lengths) - 1, index)
        raise StoreError(f"row {first_row + row} field {field}: ragged K: position {position} has {inner[index]} "
                         f"{name}s, others {expected}")
    if expected != top_k:
        raise StoreError(f"row {first_row} field {field}: K={expected}, the config's precompute.top_k is {top_k}; "
                         f"set precompute.top_k: {expected}")
    return expected


def first_position(first_row: int, row_lengths: np.ndarray, hits: np.ndarray) -> tuple[int, int] | None:
    """(source row, position) of the first True of a per-position mask, or None."""
    found = np.flatnonzero(hits)
    if not len(found):
        return None
    row, position = origin([row_lengths], 1, int(found[0]))
    return first_row + row, int(position)


def any_per_position(values: np.ndarray, lengths: list[np.ndarray]) -> np.ndarray:
    """(N,) bool: whether any of each position's entries of a `[T][K]` mask column is nonzero (`[T]`: itself)."""
    nonzero = values != 0
    if len(lengths) == 1:
        return nonzero
    counts = np.concatenate(([0], np.cumsum(nonzero, dtype=np.int64)))
    starts = np.concatenate(([0], np.cumsum(lengths[1])))
    return counts[starts[1:]] > counts[starts[:-1]]


def fail_at(first_row: int, row_lengths: np.ndarray, hits: np.ndarray, field: str, problem: str,
            after: str = "") -> None:
    """A StoreError 'row R field F: PROBLEM at position P[AFTER]' for the first True of per-position `hits`."""
    hit = first_position(first_row, row_lengths, hits)
    if hit is not None:
        raise StoreError(f"row {hit[0]} field {field}: {problem} at position {hit[1]}{after}")
