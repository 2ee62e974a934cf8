"""The student's distillation loss: forward KL over the teacher's top-K plus one tail bucket.

docs/loss.md, "The K+1-bucket KL". Per counted position, with teacher log-probs l_i on the top-K ids
(normalised over the teacher's full vocabulary), p_i = exp(l_i), tail mass p_o (v2 stores: exp(tail_logprob),
stored exactly at capture; without it 1 - sum p_i), and the student's full-vocabulary log-softmax log q
(q_o = 1 - sum over the top-K of q_i):

    KD = sum_i p_i (l_i - log q_i) + p_o (log p_o - log q_o) - s log s,    s = sum_i p_i + p_o

(s is 1 but for the store's rounding; its term keeps KD >= 0 and changes no gradient). Its gradient on the
top-K logits equals the full-vocabulary KL's; renormalising the teacher over K
instead would push the student's tail mass to zero.

At a temperature T != 1 both sides are softened exactly: the student's logits are divided by T, and the
teacher's K+1 buckets are exp(l_i / T) and exp(tail_tempered), renormalised over the K+1, where
tail_tempered = log sum_{j outside the top-K} exp(l_j / T) comes from the teacher's full logits (a store
column). Without it T != 1 is refused: the tail's tempered mass is not a function of its untempered mass.

The loss takes the student's final hidden states and its lm_head weight, never logits: the chunked core
(`kdflow.tasks.student.chunked_loss`) makes logits for `chunk_tokens` rows at a time and computes the
gradients for hidden, weight and bias chunk by chunk during the forward pass (one matmul forward, two for
the gradients, no recompute), so peak memory is O(N * H + V * H + chunk_tokens * V), never O(N * V). This
module supplies the teacher's term: the K+1 buckets of each chunk (`bucket_kd`, which the sampled loss
reuses for its head).

Not checked (it costs a sort): the top-K ids of a row are distinct, but for padding (id < 0, log-prob -inf).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kdflow.tasks.student.chunked_loss import (ChunkOptions, KDTerm, StudentChunk, check_labels, check_options,
                                               check_student_inputs, chunk_options, counted_rows,
                                               fused_distillation_loss)
from kdflow.tasks.student.renormalised_loss import RenormalisedTeacher

__all__ = ["bucket_kd", "fused_topk_kl"]


def fused_topk_kl(
    hidden: Tensor,
    weight: Tensor,
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    *,
    tail_logprob: Tensor | None = None,
    tail_tempered: Tensor | None = None,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    target: Tensor | None = None,
    untargeted_ce_weight: float = 0.0,
    normalisation: str = "full",
    labels: Tensor | None = None,
    kd_weight: float = 1.0,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    global_counts: tuple[int | Tensor, int | Tensor] | None = None,
    return_parts: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """kd_weight * KD + (1 - kd_weight) * CE, from hidden states (N, H) and lm_head weight (V, H).

    KD is the K+1-bucket forward KL averaged over counted positions (`mask`, default all); CE is the
    next-token cross-entropy averaged over counted positions whose label is not IGNORE_INDEX.
    `tail_logprob` (N,): the log of the teacher's mass outside its top-K (v2 stores); without it the tail
    is 1 - sum(exp(topk_logprobs)), clamped at 0. Padding (id < 0, log-prob -inf) counts as absent.
    `global_counts=(n_kd, n_ce)` replaces those local denominators (data parallel: each rank sums its
    part, every rank divides by the global count). With no counted position the loss is 0.

    Temperature T != 1 needs `tail_tempered` (N,): log sum over the ids outside the top-K of exp(l_j / T),
    l the teacher's full-vocabulary log-probs (a store's column for that T). Then the student's logits are
    divided by T, the teacher's buckets are exp(l_i / T) and exp(tail_tempered) renormalised over the K+1
    (the teacher's exact tempered softmax, bucketed), and KD is scaled by T^2. CE always uses the
    untempered logits. `return_parts=True` returns (loss, kd, ce) with kd (already T^2
    scaled) and ce detached, so that loss = kd_weight * kd + (1 - kd_weight) * ce.

    `target` (N,) bool: False where the teacher has no target (a masked store's prompt or padding): KD skips
    those positions (and counts only the others), their cross-entropy weighs `untargeted_ce_weight` in the loss
    instead of 1 - kd_weight (the ce part stays the plain mean over every labelled counted position).
    `normalisation="top_k"`: the store's log-probs are renormalised over the K and its tail unknown: KD is the
    renormalised-K loss (`kdflow.tasks.student.renormalised_loss`, docs/loss.md), which reads no tail and is
    exact at any temperature.

    Teacher ids >= V fold into the tail bucket (with a warning); if a row's top-K covers the whole
    student vocabulary the tail bucket is empty and its teacher mass (rounding, or folded ids the
    student cannot represent) is dropped. Under autocast the chunk matmuls run in the autocast dtype,
    the softmax/KL math in float32.
    """
    check_student_inputs(hidden, weight, bias, mask, labels)
    _check_targets(hidden, topk_ids, topk_logprobs, tail_logprob, tail_tempered)
    check_options(kd_weight, chunk_tokens, labels)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if normalisation not in ("full", "top_k"):
        raise ValueError(f"normalisation must be 'full' or 'top_k', got {normalisation!r}")
    if target is not None and (target.shape != (hidden.shape[0],) or target.dtype != torch.bool):
        raise ValueError(f"target must be a bool ({hidden.shape[0]},) tensor, got {target.dtype} {tuple(target.shape)}")
    if normalisation == "top_k":
        tail_logprob = tail_tempered = None  # unknown: never read
    elif temperature != 1.0 and tail_tempered is None:
        raise ValueError(f"temperature={temperature} needs tail_tempered, the teacher's log-sum-exp of l / T over "
                         f"the ids outside its top-K: the top-K and the tail's mass cannot soften the tail exactly")
    if temperature == 1.0:
        tail_tempered = None  # at T = 1 the tail's own log-mass is the tempered one
    vocab = weight.shape[0]
    rows = counted_rows(mask)
    if rows is not None:  # (M,)
        hidden = hidden.index_select(0, rows)  # autograd scatters the gradient back to (N, H)
        topk_ids, topk_logprobs = topk_ids.index_select(0, rows), topk_logprobs.index_select(0, rows)
        labels = None if labels is None else labels.index_select(0, rows)
        tail_logprob = None if tail_logprob is None else tail_logprob.index_select(0, rows)
        tail_tempered = None if tail_tempered is None else tail_tempered.index_select(0, rows)
        target = None if target is None else target.index_select(0, rows)
    ce_weights = None
    if target is not None and not bool(target.all()):
        topk_ids, topk_logprobs, tail_logprob, tail_tempered = _untargeted_as_padding(
            target, topk_ids, topk_logprobs, tail_logprob, tail_tempered)
        ce_weights = torch.where(target, 1.0 - kd_weight, float(untargeted_ce_weight))
    has_folded_ids = _check_teacher_ids(topk_ids, topk_logprobs, vocab)
    if labels is not None:
        check_labels(labels, vocab)
    options = chunk_options(hidden, weight, bias, labels, kd_weight=kd_weight, temperature=temperature,
                            chunk_tokens=chunk_tokens, global_counts=global_counts)
    if ce_weights is not None and global_counts is None:  # KD's local denominator: the targeted positions
        options = replace(options, kd_count=max(float(target.sum()), 1.0))
    if normalisation == "top_k":
        renormalised = RenormalisedTeacher(topk_ids, topk_logprobs.detach(), has_folded_ids)
        loss, kd, ce = fused_distillation_loss(hidden, weight, bias, renormalised, labels, options, ce_weights)
        return (loss, kd, ce) if return_parts else loss
    teacher = _TopkTeacher(topk_ids, topk_logprobs.detach(), None if tail_logprob is None else tail_logprob.detach(),
                           None if tail_tempered is None else tail_tempered.detach(), has_folded_ids)
    loss, kd, ce = fused_distillation_loss(hidden, weight, bias, teacher, labels, options, ce_weights)
    return (loss, kd, ce) if return_parts else loss


def _untargeted_as_padding(target: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, tail_logprob: Tensor | None,
                           tail_tempered: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The teacher at positions without a target made all padding (ids -1, log-probs and tails -inf), whatever
    the caller left there: every bucket is empty, so KD and its gradient are exactly 0 there."""
    if tail_logprob is None:  # the 1 - sum tail, computed here so that padding does not read as a tail of 1
        mass = topk_logprobs.detach().double().exp().sum(1)
        tail_logprob = (1.0 - mass).clamp_min(0.0).log().to(topk_logprobs.dtype)
    none = ~target
    tail_tempered = None if tail_tempered is None else tail_tempered.masked_fill(none, float("-inf"))
    return (topk_ids.masked_fill(none[:, None], -1), topk_logprobs.masked_fill(none[:, None], float("-inf")),
            tail_logprob.masked_fill(none, float("-inf")), tail_tempered)


@dataclass(frozen=True)
class _TopkTeacher:
    """What the student is fitted to, for the counted rows only; never differentiated."""

    topk_ids: Tensor  # (M, K) integer
    topk_logprobs: Tensor  # (M, K) float
    tail_logprob: Tensor | None  # (M,) float, log of the teacher's mass outside the top-K; None: 1 - sum
    tail_tempered: Tensor | None  # (M,) float, log sum of exp(l_j / T) outside the top-K; None at T = 1
    has_folded_ids: bool  # ids outside [0, V): beyond the student's vocabulary, or padding

    def chunk(self, start: int, end: int, vocab: int, options: ChunkOptions) -> _Buckets:
        tail_logprob = None if self.tail_logprob is None else self.tail_logprob[start:end]
        tempered = None if self.tail_tempered is None else (self.tail_tempered[start:end], options.temperature)
        return _teacher_buckets(self.topk_ids[start:end], self.topk_logprobs[start:end], tail_logprob, vocab,
                                tempered, options.math_dtype, self.has_folded_ids)


@dataclass(frozen=True)
class _Buckets:
    """The teacher's K+1 buckets for one chunk of rows (tempered when T != 1): a `TeacherChunk`."""

    ids: Tensor  # (C, K) long; folded ids and padding replaced by 0 (their p is 0)
    valid: Tensor  # (C, K) bool; False where the teacher id is outside the student's vocabulary, or padding
    p: Tensor  # (C, K)
    log_p: Tensor  # (C, K), -inf where p == 0
    p_tail: Tensor  # (C,)
    log_p_tail: Tensor  # (C,), -inf where p_tail == 0
    has_folded_ids: bool
    tail_ids: None = None  # the K+1 loss reads no tail logits

    def kd_term(self, student: StudentChunk, wants_grad: bool) -> KDTerm:
        return normalised_kd(bucket_kd(self.p, self.log_p, self.p_tail, self.log_p_tail, student, wants_grad),
                             self.p, self.p_tail)


def bucket_kd(p: Tensor, log_p: Tensor, p_tail: Tensor, log_p_tail: Tensor, student: StudentChunk,
              wants_grad: bool) -> KDTerm:
    """The K+1-bucket KD of a chunk: p (c, K) on the exact ids, p_tail (c,) on the tail bucket.

    With s = sum p_i + p_o: dKD/dz_i = s q_i - p_i on the exact ids, e_j (s q_o - p_o) on the tail.
    """
    kd_rows = torch.where(p > 0, p * (log_p - student.log_q_head), 0.0).sum(1)
    kd_rows += torch.where(p_tail > 0, p_tail * (log_p_tail - student.log_q_tail), 0.0)
    if not wants_grad:
        return KDTerm(kd_rows)
    mass = p.sum(1) + p_tail  # (c,) s: 1 up to rounding (or the tail clamp)
    return KDTerm(kd_rows, tail=mass * student.q_tail - p_tail, head=mass[:, None] * student.q_head - p)


def normalised_kd(term: KDTerm, p: Tensor, p_tail: Tensor) -> KDTerm:
    """The top-K loss's rows less s log s, s = sum p_i + p_o (1 but for the store's rounding): >= 0 by the log-sum
    inequality, where the K+1 sum alone fell below 0 by up to |s - 1| once the student matched the teacher (a
    random teacher's near-uniform top-K, quantised, showed a held-out "KL" of -0.0001). A constant of the teacher:
    no gradient changes. Clamped at 0 against float rounding."""
    mass = p.sum(1) + p_tail
    return term._replace(rows=(term.rows - torch.xlogy(mass, mass)).clamp_min(0.0))


def _teacher_buckets(
    topk_ids: Tensor, topk_logprobs: Tensor, tail_logprob: Tensor | None, vocab: int,
    tempered: tuple[Tensor, float] | None, math_dtype: torch.dtype, has_folded_ids: bool,
) -> _Buckets:
    """The teacher's K+1 bucket probabilities for a chunk: (C, K) top-K and (C,) tail; with `tempered`
    (tail_tempered (C,), T) those of the teacher's softmax at temperature T."""
    ids = topk_ids.long()  # (C, K)
    valid = (ids < vocab) & (ids >= 0) if has_folded_ids else torch.ones_like(ids, dtype=torch.bool)
    safe_ids = torch.where(valid, ids, 0) if has_folded_ids else ids
    log_p = topk_logprobs.to(math_dtype).masked_fill(~valid, float("-inf"))  # folded mass -> tail
    if tail_logprob is None:  # v1: the tail mass is a difference of numbers near 1: sum in float64
        p_tail = (1.0 - log_p.double().exp().sum(1)).clamp_min(0.0)  # (C,)
    else:  # stored exactly; folded ids (p > 0) join it, padding (p = 0) adds nothing
        folded = torch.where(valid, 0.0, topk_logprobs.double().exp()).sum(1) if has_folded_ids else 0.0
        p_tail = tail_logprob.double().exp() + folded  # (C,)
    tail_is_empty = valid.sum(1) >= vocab  # the top-K covers the student's whole vocabulary
    p_tail = torch.where(tail_is_empty, 0.0, p_tail)
    log_p_tail = p_tail.log().to(math_dtype)
    p_tail = p_tail.to(math_dtype)
    if tempered is not None:
        log_p, log_p_tail = _tempered_buckets(log_p, topk_logprobs, valid, tail_is_empty, *tempered, math_dtype)
        p_tail = log_p_tail.exp()
    return _Buckets(
        ids=safe_ids, valid=valid, p=log_p.exp(), log_p=log_p,
        p_tail=p_tail, log_p_tail=log_p_tail, has_folded_ids=has_folded_ids,
    )


def _tempered_buckets(log_p: Tensor, topk_logprobs: Tensor, valid: Tensor, tail_is_empty: Tensor,
                      tail_tempered: Tensor, temperature: float, math_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """log_p (C, K) of the valid ids (-inf elsewhere) -> the log of the teacher's tempered K+1 buckets:
    exp(l_i / T) and the tail's exp(tail_tempered) plus exp(l_i / T) of folded ids, over their sum (the
    teacher's full tempered normaliser, since the buckets partition its vocabulary)."""
    scaled = log_p / temperature  # (C, K)
    tail = tail_tempered.to(math_dtype)  # (C,)
    folded = torch.where(valid, float("-inf"), topk_logprobs.to(math_dtype) / temperature)  # padding: -inf
    tail = torch.logaddexp(tail, folded.logsumexp(1))
    tail = torch.where(tail_is_empty, float("-inf"), tail)
    normaliser = torch.logaddexp(scaled.logsumexp(1), tail)  # (C,)
    normaliser = torch.where(torch.isfinite(normaliser), normaliser, 0.0)  # a padding-only row stays all -inf
    return scaled - normaliser[:, None], tail - normaliser


def _check_targets(hidden: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, tail_logprob: Tensor | None,
                   tail_tempered: Tensor | None) -> None:
    rows = hidden.shape[0]
    if topk_ids.ndim != 2 or topk_ids.shape[0] != rows or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be (N={rows}, K >= 1), got {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if topk_logprobs.shape != topk_ids.shape or not topk_logprobs.is_floating_point():
        raise ValueError(f"topk_logprobs must be a float tensor shaped like topk_ids "
                         f"{tuple(topk_ids.shape)}, got {topk_logprobs.dtype} {tuple(topk_logprobs.shape)}")
    named = {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs, "tail_logprob": tail_logprob,
             "tail_tempered": tail_tempered}
    for name in ("tail_logprob", "tail_tempered"):
        tensor = named[name]
        if tensor is not None and (tensor.shape != (rows,) or not tensor.is_floating_point()):
            raise ValueError(f"{name} must be a float (N={rows},) tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    for name, tensor in named.items():
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")


def _check_teacher_ids(topk_ids: Tensor, topk_logprobs: Tensor, vocab: int) -> bool:
    """Raise on negative ids that are not padding (log-prob -inf); warn about (and report) ids beyond the
    student's vocabulary. -> whether any id is outside [0, vocab)."""
    negative = topk_ids < 0
    counts = torch.stack([(negative & (topk_logprobs != float("-inf"))).sum(), negative.sum(),
                          (topk_ids >= vocab).sum()])
    bad, padding, folded = (int(n) for n in counts)
    if bad:
        raise ValueError(f"topk_ids has {bad} negative ids in counted positions")
    if folded:
        warnings.warn(f"{folded} teacher top-K ids are >= the student's vocabulary size {vocab}; "
                      "their mass is folded into the tail bucket", stacklevel=3)
    return folded > 0 or padding > 0
