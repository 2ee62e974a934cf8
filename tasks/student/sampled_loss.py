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

Chunked like `fused_topk_kl` (whose matmul and gradient helpers it shares): logits exist for
`chunk_tokens` rows at a time, gradients are computed during the forward pass, backward only scales them;
next-token cross-entropy mixes in with `kd_weight`, and under autocast the matmuls run in its dtype.
Samples are drawn at the teacher's temperature 1, so the estimate is unbiased there only: T must be 1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from kdflow.tasks.common.sampled import SampledTargets, ht_weights
from kdflow.tasks.student.losses import (IGNORE_INDEX, PrecomputedGradients, _accumulate_grads_, _check_labels,
                                         _student_logits_, fused_topk_kl)

__all__ = ["distillation_kl", "fused_sampled_kl"]


@dataclass(frozen=True)
class _Options:
    scheme: str
    kd_weight: float
    chunk_tokens: int
    kd_count: float  # denominators, at least 1
    ce_count: float
    matmul_dtype: torch.dtype
    math_dtype: torch.dtype
    grads: tuple[bool, bool, bool]  # hidden, weight, bias


@dataclass(frozen=True)
class _Teacher:
    """One chunk's targets in the math dtype; ids outside the student's vocabulary neutralised."""

    head_ids: Tensor  # (c, H) long, folded ids replaced by 0
    head_valid: Tensor  # (c, H) bool
    p_head: Tensor  # (c, H), 0 on folded ids
    log_p_head: Tensor  # (c, H), -inf on folded ids
    p_tail: Tensor  # (c,) exact tail mass plus folded head mass; 0 if the student's tail is empty
    log_p_tail: Tensor  # (c,)
    sample_ids: Tensor  # (c, S) long, folded ids replaced by 0
    weights: Tensor  # (c, S) HT weights, 0 on folded ids
    log_p_samples: Tensor  # (c, S), 0 where the weight is 0


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
    _check(hidden, weight, targets, bias, mask, labels, kd_weight, temperature, chunk_tokens)
    if mask is not None and not bool(mask.all()):
        rows = mask.nonzero().squeeze(1)  # (M,)
        hidden = hidden.index_select(0, rows)
        targets = targets.map(lambda t: t.index_select(0, rows))
        labels = None if labels is None else labels.index_select(0, rows)
    _warn_folded(targets, weight.shape[0])
    if labels is not None:
        _check_labels(labels, weight.shape[0])
    kd_count = float(hidden.shape[0])
    ce_count = float((labels != IGNORE_INDEX).sum()) if labels is not None else 0.0
    if global_counts is not None:
        kd_count, ce_count = (float(count) for count in global_counts)
    device_type = hidden.device.type
    wants = torch.is_grad_enabled()
    math_dtype = torch.promote_types(torch.float32, torch.promote_types(hidden.dtype, weight.dtype))
    options = _Options(
        scheme=scheme, kd_weight=float(kd_weight), chunk_tokens=int(chunk_tokens),
        kd_count=max(kd_count, 1.0), ce_count=max(ce_count, 1.0),
        matmul_dtype=torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else math_dtype,
        math_dtype=math_dtype,
        grads=(wants and hidden.requires_grad, wants and weight.requires_grad,
               wants and bias is not None and bias.requires_grad),
    )
    loss, kd, ce = PrecomputedGradients.apply(_sampled_loss_and_grads, hidden, weight, bias, (targets, labels), options)
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
    targets = SampledTargets(topk_ids, topk_logprobs, tail_logprob, *samples)
    return fused_sampled_kl(hidden, weight, targets, scheme=scheme, **options)


def _sampled_loss_and_grads(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                            targets_and_labels: tuple[SampledTargets, Tensor | None], options: _Options) -> tuple:
    return _chunked_loss_and_grads(hidden, weight, bias, *targets_and_labels, options)


def _chunked_loss_and_grads(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: SampledTargets,
                            labels: Tensor | None, options: _Options) -> tuple[Tensor, Tensor, Tensor, list]:
    rows, vocab, math_dtype = hidden.shape[0], weight.shape[0], options.math_dtype
    weight_mm = weight.detach().to(options.matmul_dtype)  # (V, D); a copy only if dtypes differ
    bias_math = None if bias is None else bias.detach().to(math_dtype)
    chunk = max(1, min(options.chunk_tokens, rows))
    logits_buffer = hidden.new_empty((chunk, vocab), dtype=math_dtype)  # reused: (chunk, V)
    grad_hidden = torch.empty_like(hidden) if options.grads[0] else None  # (M, D)
    grad_weight = weight.new_zeros(weight.shape, dtype=math_dtype) if options.grads[1] else None
    grad_bias = bias.new_zeros((vocab,), dtype=math_dtype) if options.grads[2] else None
    wants_grad = any(options.grads)
    kd_coef = options.kd_weight / options.kd_count
    kd_sum = hidden.new_zeros((), dtype=torch.float64)
    ce_sum = hidden.new_zeros((), dtype=torch.float64)
    for start in range(0, rows, chunk):
        end = min(start + chunk, rows)
        hidden_mm = hidden[start:end].detach().to(options.matmul_dtype)  # (c, D)
        logits = logits_buffer[: end - start]  # (c, V)
        _student_logits_(logits, hidden_mm, weight_mm, bias_math)
        teacher = _teacher_chunk(targets.map(lambda t: t[start:end]), vocab, options)
        chunk_labels = None if labels is None else labels[start:end]
        ce_coef = None
        if chunk_labels is not None:
            ce_coef = (chunk_labels != IGNORE_INDEX).to(math_dtype) * ((1 - options.kd_weight) / options.ce_count)
        kd_rows, ce_rows = _sampled_pass_(logits, teacher, kd_coef, ce_coef, chunk_labels, wants_grad)
        kd_sum += kd_rows.sum(dtype=torch.float64)
        if ce_rows is not None:
            ce_sum += torch.where(chunk_labels != IGNORE_INDEX, ce_rows, 0).sum(dtype=torch.float64)
        if wants_grad:  # logits now hold d loss / d logits, (c, V)
            _accumulate_grads_(logits, hidden_mm, weight_mm, start, end, grad_hidden, grad_weight, grad_bias,
                               options.matmul_dtype)
    kd_mean, ce_mean = kd_sum / options.kd_count, ce_sum / options.ce_count
    loss = options.kd_weight * kd_mean + (1 - options.kd_weight) * ce_mean
    grads = [grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
             None if grad_bias is None else grad_bias.to(bias.dtype)]
    return loss.to(math_dtype), kd_mean.to(math_dtype), ce_mean.to(math_dtype), grads


def _teacher_chunk(targets: SampledTargets, vocab: int, options: _Options) -> _Teacher:
    """A chunk's targets in the math dtype, with ids outside the student's vocabulary neutralised."""
    dtype = options.math_dtype
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
    weights = ht_weights(log_p_samples, targets.log_threshold.to(dtype), options.scheme).masked_fill(~sample_valid, 0.0)
    return _Teacher(
        head_ids=torch.where(head_valid, head_ids, 0), head_valid=head_valid, p_head=log_p_head.exp(),
        log_p_head=log_p_head, p_tail=log_p_tail.exp(), log_p_tail=log_p_tail,
        sample_ids=torch.where(sample_valid, sample_ids, 0), weights=weights,
        log_p_samples=log_p_samples.masked_fill(weights == 0, 0.0),
    )


def _remove_head_(logits: Tensor, teacher: _Teacher) -> None:
    """Set the head entries of logits (c, V) to -inf; folded ids point at column 0, which is restored."""
    column_zero = logits[:, 0].clone()
    logits.scatter_(1, teacher.head_ids, -torch.inf)
    zero_in_head = ((teacher.head_ids == 0) & teacher.head_valid).any(1)
    logits[:, 0] = torch.where(zero_in_head, -torch.inf, column_zero)


def _sampled_pass_(logits: Tensor, teacher: _Teacher, kd_coef: float, ce_coef: Tensor | None, labels: Tensor | None,
                   wants_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Per-row KD^ (and CE with labels) for logits (c, V); overwrites logits with d loss / d logits."""
    z_head = logits.gather(1, teacher.head_ids).masked_fill(~teacher.head_valid, -torch.inf)  # (c, H)
    z_samples = logits.gather(1, teacher.sample_ids)  # (c, S)
    label_logits = None
    if labels is not None:
        safe_labels = labels.clamp_min(0)[:, None]  # (c, 1)
        label_logits = logits.gather(1, safe_labels).squeeze(1)  # (c,)
    _remove_head_(logits, teacher)
    shift = logits.amax(1, keepdim=True)  # (c, 1); -inf for an empty tail
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    tail_exp = logits.sub_(shift).exp_()  # (c, V): exp(z - shift) on the tail, 0 on the head
    tail_sum = tail_exp.sum(1)  # (c,)
    lse_tail = shift.squeeze(1) + tail_sum.log()  # (c,)
    lse = torch.logaddexp(lse_tail, z_head.logsumexp(1)) if z_head.shape[1] else lse_tail
    log_q_head, log_q_tail = z_head - lse[:, None], lse_tail - lse  # (c, H), (c,)

    p_head, p_tail, w = teacher.p_head, teacher.p_tail, teacher.weights
    kd_rows = torch.where(p_head > 0, p_head * (teacher.log_p_head - log_q_head), 0.0).sum(1)
    kd_rows += torch.where(p_tail > 0, p_tail * (teacher.log_p_tail - log_q_tail), 0.0)
    within = teacher.log_p_samples - torch.where(p_tail > 0, teacher.log_p_tail, 0.0)[:, None]
    within = within - (z_samples - lse_tail[:, None])  # log(p_s / p_o) - log(q_s / q_o)
    kd_rows += torch.where(w > 0, w * within, 0.0).sum(1)
    ce_rows = None if label_logits is None else lse - label_logits
    if not wants_grad:
        return kd_rows, ce_rows

    q_head, q_tail = log_q_head.exp(), log_q_tail.exp()
    mass = p_head.sum(1) + p_tail  # (c,) m
    tail_coef = kd_coef * (mass * q_tail - p_tail + w.sum(1))  # (c,)
    head_grad = kd_coef * (mass[:, None] * q_head - p_head)  # (c, H)
    if ce_coef is not None:
        tail_coef = tail_coef + ce_coef * q_tail
        head_grad = head_grad + ce_coef[:, None] * q_head
    logits.mul_(torch.where(tail_sum > 0, tail_coef / tail_sum, 0.0)[:, None])  # exp(z - shift) -> e_k * coef
    logits.scatter_add_(1, teacher.head_ids, head_grad.masked_fill(~teacher.head_valid, 0.0))
    logits.scatter_add_(1, teacher.sample_ids, -kd_coef * w)
    if labels is not None:
        logits.scatter_add_(1, safe_labels, -ce_coef[:, None])
    return kd_rows, ce_rows


def _warn_folded(targets: SampledTargets, vocab: int) -> None:
    head, samples = (int((ids >= vocab).sum()) for ids in (targets.head_ids, targets.sample_ids))
    if head or samples:
        warnings.warn(f"{head} head and {samples} sampled teacher ids are >= the student's vocabulary size {vocab}: "
                      "head mass folds into the tail bucket, samples get weight 0", stacklevel=3)


def _check(hidden: Tensor, weight: Tensor, targets: SampledTargets, bias: Tensor | None, mask: Tensor | None,
           labels: Tensor | None, kd_weight: float, temperature: float, chunk_tokens: int) -> None:
    if hidden.ndim != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float (N, D) tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    rows, width = hidden.shape
    if weight.ndim != 2 or weight.shape[1] != width or not weight.is_floating_point():
        raise ValueError(f"weight must be a float (V, {width}) tensor, got {weight.dtype} {tuple(weight.shape)}")
    for name in ("head_ids", "head_logprobs", "tail_logprob", "sample_ids", "sample_logprobs", "log_threshold"):
        tensor = getattr(targets, name)
        if tensor.shape[0] != rows or tensor.device != hidden.device:
            raise ValueError(f"targets.{name} has {tensor.shape[0]} rows on {tensor.device}, hidden {rows} on {hidden.device}")
    if targets.samples < 1:
        raise ValueError("sampled targets need at least one sample per position")
    if bool((targets.head_ids < 0).any()) or bool((targets.sample_ids < 0).any()):
        raise ValueError("targets have negative token ids")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float ({weight.shape[0]},) tensor, got {bias.dtype} {tuple(bias.shape)}")
    if mask is not None and (mask.shape != (rows,) or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool ({rows},) tensor, got {mask.dtype} {tuple(mask.shape)}")
    if labels is not None and (labels.shape != (rows,) or labels.is_floating_point() or labels.dtype == torch.bool):
        raise ValueError(f"labels must be an integer ({rows},) tensor, got {labels.dtype} {tuple(labels.shape)}")
    if not 0.0 <= kd_weight <= 1.0:
        raise ValueError(f"kd_weight must be in [0, 1], got {kd_weight}")
    if kd_weight < 1.0 and labels is None:
        raise ValueError(f"labels are required when kd_weight < 1 (got kd_weight={kd_weight})")
    if temperature != 1.0:
        raise ValueError(f"temperature must be 1 with sampled targets (drawn at the teacher's temperature 1), "
                         f"got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
