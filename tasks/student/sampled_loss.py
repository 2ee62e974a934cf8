"""The student's loss on sampled teacher targets: an unbiased estimate of the full-vocabulary forward KL.

Per counted position, with the teacher's head h (exact log-probs l_i), its tail T (the rest of the
vocabulary) with exact mass p_o = exp(tail_logprob), samples s in T with Horvitz-Thompson weights w_s
(`kdflow.tasks.common.sampled`), and the student's logits z, lse over V, lse_T over T, q_o = exp(lse_T - lse):

    KD^ = sum_{i in h} p_i (l_i - log q_i) + p_o (log p_o - log q_o)        (the K+1 loss of losses.py, exact)
        + sum_s w_s [ (l_s - log p_o) - (z_s - lse_T) ]                     (p_o x the within-tail KL, sampled)

KL(p||q) = (the K+1 loss) + sum_{j in T} p_j [log(p_j / p_o) - log(q_j / q_o)] holds exactly, and
E[sum_s w_s f_s] = sum_{j in T} p_j f_j for any f fixed before the draw, so E[KD^] = KL(p||q). KD^ is
linear in the target measure, so its gradient is unbiased too:

    dKD^/dz_i = m q_i - p_i (head, exact),   dKD^/dz_k = e_k (m q_o - p_o + W) - w_k (tail)

with m = sum_h p_i + p_o (1 up to rounding), e_k = exp(z_k - lse_T), W = sum_s w_s, w_k = 0 off the
sample; E[W] = p_o gives E[dKD^/dz_k] = q_k - p_k, and the hidden, weight and bias gradients are linear
maps of it. H = 0 (`sampled` targets): p_o = 1, lse_T = lse, the first line is 0 and the second the plain
estimate of the whole KL. The K+1 loss alone has the tail gradient e_k (q_o - p_o): right in total, blind
to the tail's shape.

Chunked by the same core as `fused_topk_kl` (`kdflow.tasks.student.chunked_loss`): logits exist for
`chunk_tokens` rows at a time, gradients are computed during the forward pass, backward only scales them;
next-token cross-entropy mixes in with `kd_weight`, and under autocast the matmuls run in its dtype. This
module supplies the per-chunk teacher term: the head's K+1 term (`losses.bucket_kd`) plus the samples'.
Samples are drawn at the teacher's temperature 1, so the estimate is unbiased there only: T must be 1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from kdflow.tasks.common.sampled import SampledTargets, ht_weights
from kdflow.tasks.student.chunked_loss import (ChunkOptions, KDTerm, StudentChunk, check_labels, check_options,
                                               check_student_inputs, chunk_options, counted_rows,
                                               fused_distillation_loss)
from kdflow.tasks.student.losses import bucket_kd, fused_topk_kl

__all__ = ["distillation_kl", "fused_sampled_kl"]


def fused_sampled_kl(
    hidden: Tensor, weight: Tensor, targets: SampledTargets, *, scheme: str, bias: Tensor | None = None,
    mask: Tensor | None = None, labels: Tensor | None = None, kd_weight: float = 1.0, temperature: float = 1.0,
    chunk_tokens: int = 4096, global_counts: tuple[int | Tensor, int | Tensor] | None = None,
    return_parts: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """kd_weight * KD^ + (1 - kd_weight) * CE from hidden states (N, D) and lm_head weight (V, D).

    targets: N positions of sampled targets, drawn with `scheme` (the store's). KD^ is averaged over
    counted positions (`mask`, default all), CE over counted positions with a label; `global_counts=(n_kd,
    n_ce)` replaces those denominators (data parallel). `return_parts=True` -> (loss, kd, ce), the parts
    detached. Teacher ids >= V (warned): head ids fold into the tail bucket, sampled ids get weight 0.
    """
    check_student_inputs(hidden, weight, bias, mask, labels)
    _check_targets(hidden, targets)
    check_options(kd_weight, chunk_tokens, labels)
    if temperature != 1.0:
        raise ValueError(f"temperature must be 1 with sampled targets (drawn at the teacher's temperature 1), "
                         f"got {temperature}")
    rows = counted_rows(mask)
    if rows is not None:  # (M,)
        hidden = hidden.index_select(0, rows)
        targets = targets.map(lambda t: t.index_select(0, rows))
        labels = None if labels is None else labels.index_select(0, rows)
    _warn_folded(targets, weight.shape[0])
    if labels is not None:
        check_labels(labels, weight.shape[0])
    options = chunk_options(hidden, weight, bias, labels, kd_weight=kd_weight, temperature=1.0,
                            chunk_tokens=chunk_tokens, global_counts=global_counts)
    loss, kd, ce = fused_distillation_loss(hidden, weight, bias, _SampledTeacher(targets, scheme), labels, options)
    return (loss, kd, ce) if return_parts else loss


def distillation_kl(hidden: Tensor, weight: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, *,
                    tail_logprob: Tensor | None = None, samples: tuple[Tensor, Tensor, Tensor] | None = None,
                    scheme: str | None = None, **options: object) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """The loss a store's targets call for, in `fused_topk_kl`'s terms: top-K targets (samples None) go to
    `fused_topk_kl`; sampled ones (topk_* = the head, samples = sample_ids (N, S), sample_logprobs (N, S),
    log_threshold (N,), scheme = the store's) to `fused_sampled_kl`. `options`: both losses' keywords."""
    if samples is None:
        return fused_topk_kl(hidden, weight, topk_ids, topk_logprobs, tail_logprob=tail_logprob, **options)
    if scheme is None or tail_logprob is None:
        raise ValueError("sampled targets need the store's sampling scheme and the head's tail_logprob")
    if options.get("target") is not None or options.get("normalisation", "full") != "full":
        raise ValueError("sampled targets carry no target mask and are normalised over the full vocabulary")
    targets = SampledTargets(topk_ids, topk_logprobs, tail_logprob, *samples)
    return fused_sampled_kl(hidden, weight, targets, scheme=scheme, **options)


@dataclass(frozen=True)
class _SampledTeacher:
    """Sampled targets of the counted rows and the scheme they were drawn with: a chunked-loss `Teacher`."""

    targets: SampledTargets
    scheme: str

    def chunk(self, start: int, end: int, vocab: int, options: ChunkOptions) -> _Teacher:
        return _teacher_chunk(self.targets.map(lambda t: t[start:end]), vocab, self.scheme, options.math_dtype)


@dataclass(frozen=True)
class _Teacher:
    """One chunk's targets in the math dtype, ids outside the student's vocabulary neutralised: a `TeacherChunk`
    whose exact ids are the head and whose tail ids are the samples."""

    ids: Tensor  # (c, H) long, the head; folded ids replaced by 0
    valid: Tensor  # (c, H) bool
    p_head: Tensor  # (c, H), 0 on folded ids
    log_p_head: Tensor  # (c, H), -inf on folded ids
    p_tail: Tensor  # (c,) exact tail mass plus folded head mass; 0 if the student's tail is empty
    log_p_tail: Tensor  # (c,)
    tail_ids: Tensor  # (c, S) long, the samples; folded ids replaced by 0
    weights: Tensor  # (c, S) HT weights, 0 on folded ids
    log_p_samples: Tensor  # (c, S), 0 where the weight is 0
    has_folded_ids: bool = True  # column 0 is always looked after (cheap)

    def kd_term(self, student: StudentChunk, wants_grad: bool) -> KDTerm:
        """The K+1 term of the head plus p_o x the within-tail KL, estimated from the samples."""
        head = bucket_kd(self.p_head, self.log_p_head, self.p_tail, self.log_p_tail, student, wants_grad)
        w = self.weights
        within = self.log_p_samples - torch.where(self.p_tail > 0, self.log_p_tail, 0.0)[:, None]
        within = within - (student.tail_logits - student.lse_tail[:, None])  # log(p_s / p_o) - log(q_s / q_o)
        rows = head.rows
        rows += torch.where(w > 0, w * within, 0.0).sum(1)
        if not wants_grad:
            return KDTerm(rows)
        return KDTerm(rows, tail=head.tail + w.sum(1), head=head.head, tail_ids=-w)


def _teacher_chunk(targets: SampledTargets, vocab: int, scheme: str, dtype: torch.dtype) -> _Teacher:
    """A chunk's targets in the math dtype, with ids outside the student's vocabulary neutralised."""
    head_ids = targets.head_ids.long()  # (c, H)
    head_valid = head_ids < vocab
    log_p_head = targets.head_logprobs.to(dtype).masked_fill(~head_valid, -torch.inf)
    log_p_tail = targets.tail_logprob.double()  # (c,)
    if head_ids.shape[1] and not bool(head_valid.all()):  # folded head mass joins the tail bucket
        folded = targets.head_logprobs.double().masked_fill(head_valid, -torch.inf)
        log_p_tail = torch.logaddexp(log_p_tail, folded.logsumexp(1))
    tail_empty = head_valid.sum(1) >= vocab  # the head covers the student's whole vocabulary
    log_p_tail = log_p_tail.masked_fill(tail_empty, -torch.inf).to(dtype)
    sample_ids = targets.sample_ids.long()  # (c, S)
    sample_valid = sample_ids < vocab
    log_p_samples = targets.sample_logprobs.to(dtype)
    weights = ht_weights(log_p_samples, targets.log_threshold.to(dtype), scheme).masked_fill(~sample_valid, 0.0)
    return _Teacher(
        ids=torch.where(head_valid, head_ids, 0), valid=head_valid, p_head=log_p_head.exp(),
        log_p_head=log_p_head, p_tail=log_p_tail.exp(), log_p_tail=log_p_tail,
        tail_ids=torch.where(sample_valid, sample_ids, 0), weights=weights,
        log_p_samples=log_p_samples.masked_fill(weights == 0, 0.0),
    )


def _warn_folded(targets: SampledTargets, vocab: int) -> None:
    head, samples = (int((ids >= vocab).sum()) for ids in (targets.head_ids, targets.sample_ids))
    if head or samples:
        warnings.warn(f"{head} head and {samples} sampled teacher ids are >= the student's vocabulary size "
                      f"{vocab}: head mass folds into the tail bucket, samples get weight 0", stacklevel=3)


def _check_targets(hidden: Tensor, targets: SampledTargets) -> None:
    rows = hidden.shape[0]
    for name in ("head_ids", "head_logprobs", "tail_logprob", "sample_ids", "sample_logprobs", "log_threshold"):
        tensor = getattr(targets, name)
        if tensor.shape[0] != rows or tensor.device != hidden.device:
            raise ValueError(f"targets.{name} has {tensor.shape[0]} rows on {tensor.device}, "
                             f"hidden {rows} on {hidden.device}")
    if targets.samples < 1:
        raise ValueError("sampled targets need at least one sample per position")
    if bool((targets.head_ids < 0).any()) or bool((targets.sample_ids < 0).any()):
        raise ValueError("targets have negative token ids")
