"""Rows of a teacher-target source in one form, whatever layout they came in: the contract between the readers
of import sources (declared layouts, DistillKit's packed rows) and the importer that packs them into a store.

Rows keep their own lengths. Arrays are flat over all positions of the rows, in order; `offsets` says where each
row begins, so a batch of ten thousand chat samples is five arrays, not ten thousand.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FULL = "full"  # log-probs normalised over the teacher's whole vocabulary: the tail is known (stored or 1 - sum p)
TOP_K = "top_k"  # log-probs renormalised over the K kept ids (or raw logits, renormalised): the tail is unknown
NORMALISATIONS = (FULL, TOP_K)


@dataclass
class SourceRows:
    """Rows [first_row, first_row + rows) of a source, checked and in canonical form.

    Per position: the token id, the teacher's K ids by descending log-prob (-1 pads a position that kept fewer)
    with their log-probs (-inf pads), whether the position has a teacher target at all (prompt tokens and masked
    positions have none; their ids and log-probs are padding), and, where the source has one, the log of the
    teacher's mass outside the K ids. Padding positions of the source (attention mask 0) are already dropped."""

    first_row: int  # the source's number of the first row here, for messages
    offsets: np.ndarray  # (rows + 1,) int64, offsets[0] == 0: row i holds positions offsets[i]:offsets[i + 1]
    tokens: np.ndarray  # (N,) int32
    ids: np.ndarray  # (N, K) int32
    logprobs: np.ndarray  # (N, K) float32
    target: np.ndarray  # (N,) bool
    tail: np.ndarray | None  # (N,) float32 <= 0, only with normalisation FULL and a tail in the source
    text: list[str] | None  # one per row, where the source holds the text (checked against the tokenizer)
    normalisation: str = FULL

    def __post_init__(self) -> None:
        if self.normalisation not in NORMALISATIONS:
            raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {self.normalisation!r}")
        n = int(self.offsets[-1]) if len(self.offsets) else 0
        if self.offsets[0] != 0 or len(self.tokens) != n or len(self.ids) != n or len(self.target) != n:
            raise ValueError(f"offsets end at {n} but the arrays hold {len(self.tokens)} positions")

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def positions(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)
