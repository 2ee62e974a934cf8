"""The student's distillation loss: forward KL over the teacher's top-K plus one tail bucket.

docs/loss.md, "The K+1-bucket KL". Per counted position, with teacher log-probs l_i on the top-K ids
(normalised over the teacher's full vocabulary), p_i = exp(l_i), tail mass p_o (v2 stores: exp(tail_logprob),
stored exactly at capture; without it 1 - sum p_i), and the student's full-vocabulary log-softmax log q
(q_o = 1 - sum over the top-K of q_i):

    KD = sum_i p_i (l_i - log q_i) + p_o (log p_o - log q_o)

Its gradient on the top-K logits equals the full-vocabulary KL's; renormalising the teacher over K
instead would push the student's tail mass to zero.

The loss takes the student's final hidden states and its lm_head weight, never logits: logits exist for
`chunk_tokens` rows at a time, and the gradients for hidden, weight and bias are computed chunk by chunk
during the forward pass (one matmul forward, two for the gradients, no recompute), so peak memory is
O(N * H + V * H + chunk_tokens * V), never O(N * V).

Not checked (it costs a sort): the top-K ids of a row are distinct, but for padding (id < 0, log-prob -inf).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "fused_topk_kl"]


@dataclass(frozen=True)
class _Targets:
    """What the student is fitted to, for the counted rows only; never differentiated."""

    topk_ids: Tensor  # (M, K) integer
    topk_logprobs: Tensor  # (M, K) float
    tail_logprob: Tensor | None  # (M,) float, log of the teacher's mass outside the top-K; None: 1 - sum
    labels: Tensor | None  # (M,) long, IGNORE_INDEX = no label


@dataclass(frozen=True)
class _Options:
    kd_weight: float
    temperature: float
    chunk_tokens: int
    kd_count: float  # denominators (local or global counts, at least 1)
    ce_count: float
    matmul_dtype: torch.dtype  # dtype of the chunk matmuls
    math_dtype: torch.dtype  # dtype of softmax / KL math (float32, or float64 for float64 inputs)
    has_folded_ids: bool  # ids outside [0, V): beyond the student's vocabulary, or padding
    grad_hidden: bool
    grad_weight: bool
    grad_bias: bool


@dataclass(frozen=True)
class _Buckets:
    """The teacher's K+1 buckets for one chunk of rows (tempered when T != 1)."""

    safe_ids: Tensor  # (C, K) long; folded ids and padding replaced by 0 (their p is 0)
    valid: Tensor  # (C, K) bool; False where the teacher id is outside the student's vocabulary, or padding
    p: Tensor  # (C, K)
    log_p: Tensor  # (C, K), -inf where p == 0
    p_tail: Tensor  # (C,)
    log_p_tail: Tensor  # (C,), -inf where p_tail == 0
    has_folded_ids: bool


def fused_topk_kl(
    hidden: Tensor,
    weight: Tensor,
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    *,
    tail_logprob: Tensor | None = None,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
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

    Temperature T != 1 uses the bucket approximation: student logits / T, teacher buckets
    exp(l_i / T) and exp(log p_o / T) renormalised over the K+1 buckets, KD scaled by T^2. CE always
    uses the untempered logits. `return_parts=True` returns (loss, kd, ce) with kd (already T^2
    scaled) and ce detached, so that loss = kd_weight * kd + (1 - kd_weight) * ce.

    Teacher ids >= V fold into the tail bucket (with a warning); if a row's top-K covers the whole
    student vocabulary the tail bucket is empty and its teacher mass (rounding, or folded ids the
    student cannot represent) is dropped. Under autocast the chunk matmuls run in the autocast dtype,
    the softmax/KL math in float32.
    """
    _check_inputs(hidden, weight, topk_ids, topk_logprobs, bias, mask, labels, tail_logprob)
    _check_options(kd_weight, temperature, chunk_tokens, labels)
    vocab = weight.shape[0]
    if mask is not None and not bool(mask.all()):
        rows = mask.nonzero().squeeze(1)  # (M,)
        hidden = hidden.index_select(0, rows)  # autograd scatters the gradient back to (N, H)
        topk_ids, topk_logprobs = topk_ids.index_select(0, rows), topk_logprobs.index_select(0, rows)
        labels = None if labels is None else labels.index_select(0, rows)
        tail_logprob = None if tail_logprob is None else tail_logprob.index_select(0, rows)
    has_folded_ids = _check_teacher_ids(topk_ids, topk_logprobs, vocab)
    if labels is not None:
        _check_labels(labels, vocab)

    kd_count, ce_count = hidden.shape[0], 0
    if labels is not None:
        ce_count = int((labels != IGNORE_INDEX).sum())
    if global_counts is not None:
        kd_count, ce_count = (float(count) for count in global_counts)
        if kd_count < 0 or ce_count < 0:
            raise ValueError(f"global_counts must be non-negative, got {global_counts}")

    device_type = hidden.device.type
    wants_grad = torch.is_grad_enabled()
    math_dtype = torch.promote_types(torch.float32, torch.promote_types(hidden.dtype, weight.dtype))
    options = _Options(
        kd_weight=float(kd_weight),
        temperature=float(temperature),
        chunk_tokens=int(chunk_tokens),
        kd_count=max(float(kd_count), 1.0),
        ce_count=max(float(ce_count), 1.0),
        matmul_dtype=(
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else math_dtype
        ),
        math_dtype=math_dtype,
        has_folded_ids=has_folded_ids,
        grad_hidden=wants_grad and hidden.requires_grad,
        grad_weight=wants_grad and weight.requires_grad,
        grad_bias=wants_grad and bias is not None and bias.requires_grad,
    )
    targets = _Targets(topk_ids, topk_logprobs.detach(), None if tail_logprob is None else tail_logprob.detach(), labels)
    loss, kd, ce = PrecomputedGradients.apply(_chunked_loss_and_grads, hidden, weight, bias, targets, options)
    return (loss, kd, ce) if return_parts else loss


class PrecomputedGradients(torch.autograd.Function):
    """Loss and all gradients in one chunked pass, `compute(hidden, weight, bias, targets, options)` -> (loss,
    kd, ce, (grad_hidden, grad_weight, grad_bias)); backward only scales the stored gradients. Shared by the
    top-K loss and the sampled one (kdflow.tasks.student.sampled_loss)."""

    @staticmethod
    def forward(ctx, compute, hidden, weight, bias, targets, options):  # type: ignore[override]
        with torch.autocast(hidden.device.type, enabled=False):
            loss, kd, ce, grads = compute(hidden, weight, bias, targets, options)
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(kd, ce)
        return loss, kd, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_kd, _grad_ce):  # type: ignore[override]
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return None, scaled[0], scaled[1], scaled[2], None, None


def _chunked_loss_and_grads(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: _Targets, options: _Options
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    rows, vocab = hidden.shape[0], weight.shape[0]
    temperature, math_dtype = options.temperature, options.math_dtype
    weight_mm = weight.detach().to(options.matmul_dtype)  # (V, H); a copy only if dtypes differ
    bias_math = None if bias is None else bias.detach().to(math_dtype)  # (V,)
    chunk = max(1, min(options.chunk_tokens, rows))
    separate_ce = temperature != 1.0 and targets.labels is not None  # CE needs untempered logits
    # Preallocated and reused: fresh (chunk, V) allocations cost page faults on every chunk.
    logits_buffer = hidden.new_empty((chunk, vocab), dtype=math_dtype)
    raw_buffer = torch.empty_like(logits_buffer) if separate_ce else None
    grad_hidden = torch.empty_like(hidden) if options.grad_hidden else None  # (M, H)
    grad_weight = weight.new_zeros(weight.shape, dtype=math_dtype) if options.grad_weight else None
    grad_bias = bias.new_zeros((vocab,), dtype=math_dtype) if options.grad_bias else None
    wants_grad = options.grad_hidden or options.grad_weight or options.grad_bias
    kd_coef = options.kd_weight * temperature / options.kd_count  # d loss / d (logits / T) scale
    kd_sum = hidden.new_zeros((), dtype=torch.float64)
    ce_sum = hidden.new_zeros((), dtype=torch.float64)

    for start in range(0, rows, chunk):
        end = min(start + chunk, rows)
        hidden_mm = hidden[start:end].detach().to(options.matmul_dtype)  # (c, H)
        logits = logits_buffer[: end - start]  # (c, V)
        _student_logits_(logits, hidden_mm, weight_mm, bias_math)
        tail_logprob = None if targets.tail_logprob is None else targets.tail_logprob[start:end]
        buckets = _teacher_buckets(targets.topk_ids[start:end], targets.topk_logprobs[start:end], tail_logprob,
                                   vocab, temperature, math_dtype, options.has_folded_ids)
        labels = None if targets.labels is None else targets.labels[start:end]  # (c,)
        ce_coef = None
        if labels is not None:
            ce_coef = (labels != IGNORE_INDEX).to(math_dtype) * ((1 - options.kd_weight) / options.ce_count)
        if separate_ce:
            raw_logits = raw_buffer[: end - start]
            raw_logits.copy_(logits)
            logits.div_(temperature)
            kd_rows, _ = _partition_pass_(logits, buckets, kd_coef, None, None, wants_grad)
            _, ce_rows = _partition_pass_(raw_logits, buckets, 0.0, ce_coef, labels, wants_grad)
            if wants_grad:
                logits.add_(raw_logits)
        else:
            if temperature != 1.0:
                logits.div_(temperature)
            kd_rows, ce_rows = _partition_pass_(logits, buckets, kd_coef, ce_coef, labels, wants_grad)
        kd_sum += kd_rows.sum(dtype=torch.float64)
        if ce_rows is not None:
            ce_sum += torch.where(labels != IGNORE_INDEX, ce_rows, 0).sum(dtype=torch.float64)
        if wants_grad:  # `logits` now holds d loss / d logits for the chunk, (c, V)
            _accumulate_grads_(logits, hidden_mm, weight_mm, start, end,
                               grad_hidden, grad_weight, grad_bias, options.matmul_dtype)

    kd_mean = kd_sum * temperature**2 / options.kd_count
    ce_mean = ce_sum / options.ce_count
    loss = options.kd_weight * kd_mean + (1 - options.kd_weight) * ce_mean
    out_dtype = torch.float32 if math_dtype == torch.float32 else math_dtype
    grads = [
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    ]
    return loss.to(out_dtype), kd_mean.to(out_dtype), ce_mean.to(out_dtype), grads


def _student_logits_(out: Tensor, hidden_mm: Tensor, weight_mm: Tensor, bias: Tensor | None) -> None:
    """out (c, V) <- hidden_mm (c, H) @ weight_mm.T (+ bias), in out's dtype."""
    if hidden_mm.dtype == out.dtype:
        if bias is None:
            torch.matmul(hidden_mm, weight_mm.t(), out=out)
        else:
            torch.addmm(bias, hidden_mm, weight_mm.t(), out=out)
        return
    out.copy_(hidden_mm @ weight_mm.t())  # low-precision matmul (autocast), math in out's dtype
    if bias is not None:
        out.add_(bias)


def _accumulate_grads_(
    grad_logits: Tensor, hidden_mm: Tensor, weight_mm: Tensor, start: int, end: int,
    grad_hidden: Tensor | None, grad_weight: Tensor | None, grad_bias: Tensor | None,
    matmul_dtype: torch.dtype,
) -> None:
    """Chain rule through logits = hidden @ weight.T + bias for one chunk of rows."""
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)  # (V,)
    grad_mm = grad_logits if grad_logits.dtype == matmul_dtype else grad_logits.to(matmul_dtype)
    if grad_hidden is not None:
        grad_hidden[start:end] = grad_mm @ weight_mm  # (c, V) @ (V, H)
    if grad_weight is None:
        return
    if grad_weight.dtype == matmul_dtype:
        grad_weight.addmm_(grad_mm.t(), hidden_mm)  # (V, c) @ (c, H), accumulated in place
    else:
        grad_weight += grad_mm.t() @ hidden_mm


def _teacher_buckets(
    topk_ids: Tensor, topk_logprobs: Tensor, tail_logprob: Tensor | None, vocab: int, temperature: float,
    math_dtype: torch.dtype, has_folded_ids: bool,
) -> _Buckets:
    """The teacher's K+1 bucket probabilities for a chunk: (C, K) top-K and (C,) tail."""
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
    if temperature != 1.0:
        tempered = torch.cat([log_p, log_p_tail[:, None]], dim=1) / temperature  # (C, K + 1)
        tempered = torch.log_softmax(tempered, dim=1)
        log_p, log_p_tail = tempered[:, :-1], tempered[:, -1]
        p_tail = log_p_tail.exp()
    return _Buckets(
        safe_ids=safe_ids, valid=valid, p=log_p.exp(), log_p=log_p,
        p_tail=p_tail, log_p_tail=log_p_tail, has_folded_ids=has_folded_ids,
    )


def _remove_top_k_(logits: Tensor, buckets: _Buckets) -> None:
    """Set the top-K entries of logits (c, V) to -inf so that what remains is the tail bucket."""
    if not buckets.has_folded_ids:
        logits.scatter_(1, buckets.safe_ids, float("-inf"))
        return
    # Folded ids point at column 0 as a placeholder: restore it unless 0 is a real top-K id.
    column_zero = logits[:, 0].clone()
    logits.scatter_(1, buckets.safe_ids, float("-inf"))
    zero_in_top_k = ((buckets.safe_ids == 0) & buckets.valid).any(1)
    logits[:, 0] = torch.where(zero_in_top_k, float("-inf"), column_zero)


def _partition_pass_(
    logits: Tensor, buckets: _Buckets, kd_coef: float, ce_coef: Tensor | None,
    labels: Tensor | None, wants_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Per-row KD (and CE if labels) for logits (c, V); overwrites logits with d loss / d logits.

    The gradient is kd_coef * dKD + ce_coef * dCE per row. With s = sum p_i + p_o and the tail
    softmax e_j = exp(z_j - lse_tail): dKD/dz_i = s q_i - p_i on the top-K, e_j (s q_o - p_o) on the
    tail; dCE/dz_j = q_j - [j = label], with q_j = e_j q_o on the tail. Working from the tail softmax
    keeps every factor bounded even when q_o underflows.
    """
    top_logits = logits.gather(1, buckets.safe_ids)  # (c, K)
    label_logits = None
    if labels is not None:
        safe_labels = labels.clamp_min(0)[:, None]  # (c, 1)
        label_logits = logits.gather(1, safe_labels).squeeze(1)  # (c,)
    _remove_top_k_(logits, buckets)
    shift = logits.amax(1, keepdim=True)  # (c, 1); -inf for an empty tail
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    tail_exp = logits.sub_(shift).exp_()  # (c, V), exp(z_j - shift) on the tail, 0 on the top-K
    tail_sum = tail_exp.sum(1)  # (c,)
    lse_tail = shift.squeeze(1) + tail_sum.log()  # (c,)
    lse_top = top_logits.masked_fill(~buckets.valid, float("-inf")).logsumexp(1)
    lse = torch.logaddexp(lse_tail, lse_top)  # (c,) full-vocabulary log-sum-exp
    log_q_top = top_logits - lse[:, None]  # (c, K)
    log_q_tail = lse_tail - lse  # (c,)

    p, p_tail = buckets.p, buckets.p_tail
    kd_rows = torch.where(p > 0, p * (buckets.log_p - log_q_top), 0.0).sum(1)
    kd_rows += torch.where(p_tail > 0, p_tail * (buckets.log_p_tail - log_q_tail), 0.0)
    ce_rows = None if label_logits is None else lse - label_logits
    if not wants_grad:
        return kd_rows, ce_rows

    q_top, q_tail = log_q_top.exp(), log_q_tail.exp()
    mass = p.sum(1) + p_tail  # (c,) s: 1 up to rounding (or the tail clamp)
    tail_coef = kd_coef * (mass * q_tail - p_tail)  # (c,)
    top_grad = kd_coef * (mass[:, None] * q_top - p)  # (c, K)
    if ce_coef is not None:
        tail_coef = tail_coef + ce_coef * q_tail
        top_grad = top_grad + ce_coef[:, None] * q_top
    tail_scale = torch.where(tail_sum > 0, tail_coef / tail_sum, 0.0)  # exp(z - shift) -> e_j
    logits.mul_(tail_scale[:, None])
    logits.scatter_add_(1, buckets.safe_ids, top_grad.masked_fill(~buckets.valid, 0.0))
    if labels is not None:
        logits.scatter_add_(1, safe_labels, -ce_coef[:, None])
    return kd_rows, ce_rows


def _check_inputs(
    hidden: Tensor, weight: Tensor, topk_ids: Tensor, topk_logprobs: Tensor,
    bias: Tensor | None, mask: Tensor | None, labels: Tensor | None, tail_logprob: Tensor | None = None,
) -> None:
    if hidden.ndim != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float (N, H) tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    rows, width = hidden.shape
    if weight.ndim != 2 or weight.shape[1] != width or not weight.is_floating_point():
        raise ValueError(f"weight must be a float (V, {width}) tensor, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != rows or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be (N={rows}, K >= 1), got {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if topk_logprobs.shape != topk_ids.shape or not topk_logprobs.is_floating_point():
        raise ValueError(f"topk_logprobs must be a float tensor shaped like topk_ids "
                         f"{tuple(topk_ids.shape)}, got {topk_logprobs.dtype} {tuple(topk_logprobs.shape)}")
    if tail_logprob is not None and (tail_logprob.shape != (rows,) or not tail_logprob.is_floating_point()):
        raise ValueError(f"tail_logprob must be a float (N={rows},) tensor, got {tail_logprob.dtype} {tuple(tail_logprob.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float ({weight.shape[0]},) tensor, "
                         f"got {bias.dtype} {tuple(bias.shape)}")
    if mask is not None and (mask.shape != (rows,) or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool ({rows},) tensor, got {mask.dtype} {tuple(mask.shape)}")
    if labels is not None and (labels.shape != (rows,) or labels.is_floating_point()
                               or labels.dtype == torch.bool):
        raise ValueError(f"labels must be an integer ({rows},) tensor, "
                         f"got {labels.dtype} {tuple(labels.shape)}")
    named = {"weight": weight, "topk_ids": topk_ids, "topk_logprobs": topk_logprobs,
             "bias": bias, "mask": mask, "labels": labels, "tail_logprob": tail_logprob}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")


def _check_options(kd_weight: float, temperature: float, chunk_tokens: int, labels: Tensor | None) -> None:
    if not 0.0 <= kd_weight <= 1.0:
        raise ValueError(f"kd_weight must be in [0, 1], got {kd_weight}")
    if kd_weight < 1.0 and labels is None:
        raise ValueError(f"labels are required when kd_weight < 1 (got kd_weight={kd_weight})")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def _check_teacher_ids(topk_ids: Tensor, topk_logprobs: Tensor, vocab: int) -> bool:
    """Raise on negative ids that are not padding (log-prob -inf); warn about (and report) ids beyond the
    student's vocabulary. -> whether any id is outside [0, vocab)."""
    negative = topk_ids < 0
    counts = torch.stack([(negative & (topk_logprobs != float("-inf"))).sum(), negative.sum(), (topk_ids >= vocab).sum()])
    bad, padding, folded = (int(n) for n in counts)
    if bad:
        raise ValueError(f"topk_ids has {bad} negative ids in counted positions")
    if folded:
        warnings.warn(f"{folded} teacher top-K ids are >= the student's vocabulary size {vocab}; "
                      "their mass is folded into the tail bucket", stacklevel=3)
    return folded > 0 or padding > 0


def _check_labels(labels: Tensor, vocab: int) -> None:
    bad = ((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))).sum()
    if int(bad):
        raise ValueError(f"labels has {int(bad)} ids outside [0, {vocab}) that are not {IGNORE_INDEX}")
