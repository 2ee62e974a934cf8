"""Rows of any length (SourceRows) packed into fixed rows of `seq_len` positions, as tokenise packs documents.

The positions of all source rows are concatenated in source order and cut every `seq_len` positions: a row longer
than what is left of a packed row continues in the next one, and the final remainder that does not fill a packed
row is dropped (and counted), exactly as the tokenise stage does with documents. Unlike tokenise, no EOS is put
between rows: every position carries the teacher's distribution for it, and there is none for an invented token
(a source row that ends in EOS keeps its own). Each packed position keeps its token, its K ids and log-probs, its
target flag (False: no teacher target there) and its tail.

The packer knows the stream position (source row, offset into it) after every packed row, so an import that
stopped after packed row n resumes from there and packs the same rows: the result depends only on the source.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from kdflow.tasks.teacher.source_rows import SourceRows


@dataclass
class PackedRows:
    """Packed rows of `seq_len` positions, as a top-K shard and its token shard hold them."""

    tokens: np.ndarray  # (n, T) int32
    ids: np.ndarray  # (n, T, K) int32
    logprobs: np.ndarray  # (n, T, K) float32
    target: np.ndarray  # (n, T) bool
    tail: np.ndarray | None  # (n, T) float32, where the source has a tail

    @property
    def rows(self) -> int:
        return len(self.tokens)


_FIELDS = ("tokens", "ids", "logprobs", "target", "tail")


class RowPacker:
    """Packs SourceRows into seq_len rows; `position()` is the stream position after the rows taken so far."""

    def __init__(self, seq_len: int, start: tuple[int, int] = (0, 0)) -> None:
        self.seq_len = seq_len
        self.start = start  # (source row, offset): positions before it were packed by an earlier run
        self.chunks: dict[str, list[np.ndarray]] = {name: [] for name in _FIELDS}
        self.buffered = 0  # positions held, not yet packed
        self.rows_seen: deque[list[int]] = deque()  # [source row, its positions still held, its full length]
        self.next_row = start[0]  # the first source row not yet added
        self.has_tail: bool | None = None

    def add(self, rows: SourceRows) -> None:
        """Append rows (in source order, each batch following the last); rows before `start` are skipped."""
        lengths = rows.lengths()
        first = max(self.start[0] - rows.first_row, 0)  # index of the first row not entirely packed before
        if first >= rows.rows:
            return
        begin = int(rows.offsets[first])
        if rows.first_row + first == self.start[0]:
            begin += self.start[1]
        if rows.first_row + first != self.next_row:
            raise ValueError(f"rows arrive out of order: row {rows.first_row + first}, expected {self.next_row}")
        has_tail = rows.tail is not None
        if self.has_tail is not None and has_tail != self.has_tail:
            raise ValueError(f"row {rows.first_row}: a tail in some rows of the source and not in others")
        self.has_tail = has_tail
        for name in _FIELDS:
            array = getattr(rows, name)
            if array is not None:
                self.chunks[name].append(array[begin:])
        for index in range(first, rows.rows):
            full = int(lengths[index])
            held = full - (begin - int(rows.offsets[first]) if index == first else 0)
            self.rows_seen.append([rows.first_row + index, held, full])
        self.buffered += rows.positions - begin
        self.next_row = rows.first_row + rows.rows

    def rows_ready(self) -> int:
        return self.buffered // self.seq_len

    def _cut(self, count: int) -> dict[str, np.ndarray | None]:
        out: dict[str, np.ndarray | None] = {}
        for name in _FIELDS:
            chunks = self.chunks[name]
            if not chunks:
                out[name] = None
                continue
            joined = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            out[name] = joined[:count]
            self.chunks[name] = [joined[count:]] if len(joined) > count else []
        return out

    def take(self, rows: int) -> PackedRows:
        """The next `rows` packed rows (at most rows_ready())."""
        count = rows * self.seq_len
        if rows > self.rows_ready():
            raise ValueError(f"{rows} rows asked, {self.rows_ready()} ready")
        cut = self._cut(count)
        self.buffered -= count
        left = count
        while left and self.rows_seen:
            seen = self.rows_seen[0]
            if seen[1] <= left:
                left -= seen[1]
                self.rows_seen.popleft()
            else:
                seen[1] -= left
                left = 0
        shape = (rows, self.seq_len)
        tail = cut["tail"]
        return PackedRows(cut["tokens"].reshape(shape), cut["ids"].reshape(*shape, -1),
                          cut["logprobs"].reshape(*shape, -1), cut["target"].reshape(shape),
                          None if tail is None else tail.reshape(shape))

    def position(self) -> tuple[int, int]:
        """(source row, offset into it) of the first position not yet packed."""
        while self.rows_seen and self.rows_seen[0][1] == 0:  # empty rows: nothing of them is held
            self.rows_seen.popleft()
        if not self.rows_seen:
            return self.next_row, 0
        row, held, full = self.rows_seen[0]
        return row, full - held

    @property
    def remainder(self) -> int:
        """Positions held that do not fill a packed row (dropped at the end of the source)."""
        return self.buffered
