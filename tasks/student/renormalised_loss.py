"""The renormalised-K teacher term, for top-K stores whose log-probs are renormalised over the K ids (or raw
logits so renormalised): the teacher's tail mass is unknown, so the student is fitted within the K alone.

docs/loss.md, "The renormalised-K loss". Per counted position, with the teacher's K log-probs l_i renormalised
over the K (p_i = exp(l_i) / sum_j exp(l_j)) and the student's log-softmax restricted to the same ids and
renormalised there (r_i = q_i / sum_j q_j = exp(z_i - lse_K z)):

    KD = sum_i p_i (log p_i - log r_i),     dKD/dz_i = s r_i - p_i on the K ids, 0 elsewhere (s = sum_i p_i)

(s is 1, or 0 at a position without a target). It says nothing about the student's mass outside the K: what
the K+1 loss's tail bucket would fit is left free, as in the top-K losses of other trainers (axolotl's, and
DistillKit's). Tempering is exact here: p at temperature T is the softmax of l / T over the K, and the core
divides the student's logits by T. Padding and ids outside the student's vocabulary leave the K (renormalised
over the rest); a position with none left contributes 0.

A `Teacher` of the chunked core (`kdflow.tasks.student.chunked_loss`), which makes logits `chunk_tokens` rows at a
time and computes the gradients during the forward pass; this module supplies the per-chunk term only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kdflow.tasks.student.chunked_loss import ChunkOptions, KDTerm, StudentChunk


@dataclass(frozen=True)
class RenormalisedTeacher:
    """The counted rows' top-K targets, to be renormalised over the K: a chunked-loss `Teacher`."""

    topk_ids: Tensor  # (M, K) integer; -1 (or any id outside the vocabulary) leaves the K
    topk_logprobs: Tensor  # (M, K) float; only differences within a position matter
    has_folded_ids: bool

    def chunk(self, start: int, end: int, vocab: int, options: ChunkOptions) -> RenormalisedChunk:
        ids = self.topk_ids[start:end].long()
        valid = (ids >= 0) & (ids < vocab) if self.has_folded_ids else torch.ones_like(ids, dtype=torch.bool)
        log_p = (self.topk_logprobs[start:end].to(options.math_dtype) / options.temperature).masked_fill(
            ~valid, float("-inf"))
        log_p = log_p - _finite(log_p.logsumexp(1))[:, None]
        return RenormalisedChunk(ids=torch.where(valid, ids, 0) if self.has_folded_ids else ids, valid=valid,
                                 p=log_p.exp(), log_p=log_p, has_folded_ids=self.has_folded_ids)


@dataclass(frozen=True)
class RenormalisedChunk:
    """One chunk's teacher, renormalised over its valid ids: a `TeacherChunk` that reads no tail."""

    ids: Tensor  # (c, K) long, placeholders 0 where not valid
    valid: Tensor  # (c, K) bool
    p: Tensor  # (c, K), summing to 1 over the valid ids (0 on a row with none)
    log_p: Tensor  # (c, K), -inf where not valid
    has_folded_ids: bool
    tail_ids: None = None

    def kd_term(self, student: StudentChunk, wants_grad: bool) -> KDTerm:
        log_r = student.log_q_head - _finite(student.log_q_head.logsumexp(1))[:, None]  # -inf where not valid
        rows = torch.where(self.p > 0, self.p * (self.log_p - log_r), 0.0).sum(1)
        if not wants_grad:
            return KDTerm(rows)
        mass = self.p.sum(1, keepdim=True)  # (c, 1): 1, or 0 without valid ids
        head = torch.where(self.valid, mass * log_r.exp() - self.p, 0.0)
        return KDTerm(rows, tail=torch.zeros_like(rows), head=head)


def _finite(lse: Tensor) -> Tensor:
    """A log-normaliser with -inf (a row without valid ids) replaced by 0, so that -inf - (-inf) never makes NaN."""
    return torch.where(torch.isfinite(lse), lse, 0.0)
