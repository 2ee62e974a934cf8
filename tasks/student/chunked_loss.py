"""The chunked distillation loss core, shared by the top-K loss (losses.py) and the sampled one (sampled_loss.py).

docs/loss.md has the maths. This module owns everything but the teacher: the checks of the student's inputs
and the labels, the counts, the loop over `chunk_tokens` rows of the student's logits (one reused (chunk, V)
buffer), the next-token cross-entropy, the temperature, the chain rule to the hidden states, lm_head weight
and bias, and `PrecomputedGradients`, which computes the loss and every gradient during the forward pass so
that backward only scales them: peak memory O(N * H + V * H + chunk_tokens * V), never O(N * V).

A loss supplies its teacher (`Teacher`): per chunk of rows a `TeacherChunk` that names the ids it knows
exactly (the top-K, or the head: singled out of the student's softmax, the rest is the tail) and gives its
KD term from the student's partition of the chunk (`StudentChunk`): per-row KD and the gradient factors.
Liger-Kernel splits its fused linear distillation base and `distillation_loss_fn` the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

IGNORE_INDEX = -100  # a label that counts for no cross-entropy

__all__ = ["IGNORE_INDEX", "ChunkOptions", "KDTerm", "PrecomputedGradients", "StudentChunk", "Teacher",
           "TeacherChunk", "check_labels", "check_options", "check_student_inputs", "chunk_options", "counted_rows",
           "fused_distillation_loss"]


@dataclass(frozen=True)
class ChunkOptions:
    kd_weight: float
    temperature: float
    chunk_tokens: int
    kd_count: float  # denominators (local or global counts, at least 1)
    ce_count: float
    matmul_dtype: torch.dtype  # dtype of the chunk matmuls
    math_dtype: torch.dtype  # dtype of softmax / KL math (float32, or float64 for float64 inputs)
    grad_hidden: bool
    grad_weight: bool
    grad_bias: bool


class StudentChunk(NamedTuple):
    """The student's side of one chunk (c rows), split into the teacher's exact ids and the tail."""

    log_q_head: Tensor  # (c, K) log q_i on the teacher's exact ids, -inf where they are not valid
    log_q_tail: Tensor  # (c,) log q_o, the tail bucket's mass
    lse_tail: Tensor  # (c,) log-sum-exp of the logits over the tail
    tail_logits: Tensor | None  # (c, S) logits on `TeacherChunk.tail_ids`
    q_head: Tensor | None  # exp(log_q_head), exp(log_q_tail): only when gradients are wanted
    q_tail: Tensor | None


class KDTerm(NamedTuple):
    """A chunk's KD term: per-row KD and, when gradients are wanted, the factors of d KD / d logits: `tail`
    (c,) times the tail softmax e_j on every tail id, `head` (c, K) on the exact ids, `tail_ids` (c, S) added
    on `TeacherChunk.tail_ids`. The core scales them by kd_weight * T / kd_count."""

    rows: Tensor
    tail: Tensor | None = None
    head: Tensor | None = None
    tail_ids: Tensor | None = None


class TeacherChunk(Protocol):
    """One chunk of a loss's teacher targets, in the math dtype."""

    ids: Tensor  # (c, K) long: the exact ids, those outside the student's vocabulary (or padding) replaced by 0
    valid: Tensor  # (c, K) bool: False where `ids` holds such a placeholder
    has_folded_ids: bool  # any placeholder in `ids` (else column 0 needs no care)
    tail_ids: Tensor | None  # (c, S) long: tail ids whose logits the term reads, or None

    def kd_term(self, student: StudentChunk, wants_grad: bool) -> KDTerm: ...


class Teacher(Protocol):
    """A loss's targets for the counted rows; never differentiated."""

    def chunk(self, start: int, end: int, vocab: int, options: ChunkOptions) -> TeacherChunk: ...


def fused_distillation_loss(hidden: Tensor, weight: Tensor, bias: Tensor | None, teacher: Teacher,
                            labels: Tensor | None, options: ChunkOptions, ce_weights: Tensor | None = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, kd, ce) over the counted rows of hidden (M, H), with gradients for hidden, weight and bias.
    `ce_weights` (M,): each row's weight of cross-entropy in the loss (None: 1 - kd_weight everywhere); then
    loss = kd_weight * kd + sum(ce_weights * ce_rows) / ce_count, and ce stays the plain mean."""
    return PrecomputedGradients.apply(_chunked_loss_and_grads, hidden, weight, bias, (teacher, labels, ce_weights),
                                      options)


class PrecomputedGradients(torch.autograd.Function):
    """Loss and all gradients in one chunked pass, `compute(hidden, weight, bias, targets, options)` -> (loss,
    kd, ce, (grad_hidden, grad_weight, grad_bias)); backward only scales the stored gradients."""

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


def counted_rows(mask: Tensor | None) -> Tensor | None:
    """The indices (M,) of the counted rows, or None when every row counts (no copies then)."""
    return None if mask is None or bool(mask.all()) else mask.nonzero().squeeze(1)


def chunk_options(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor | None, *, kd_weight: float,
                  temperature: float, chunk_tokens: int,
                  global_counts: tuple[int | Tensor, int | Tensor] | None) -> ChunkOptions:
    """The options of one call on the counted rows: denominators (`global_counts=(n_kd, n_ce)` replaces the
    local counts), the matmul dtype (autocast's when it is on), the math dtype, which gradients are wanted."""
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
    return ChunkOptions(
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
        grad_hidden=wants_grad and hidden.requires_grad,
        grad_weight=wants_grad and weight.requires_grad,
        grad_bias=wants_grad and bias is not None and bias.requires_grad,
    )


def _chunked_loss_and_grads(
    hidden: Tensor, weight: Tensor, bias: Tensor | None,
    teacher_and_labels: tuple[Teacher, Tensor | None, Tensor | None], options: ChunkOptions,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    teacher, labels, ce_weights = teacher_and_labels
    rows, vocab = hidden.shape[0], weight.shape[0]
    temperature, math_dtype = options.temperature, options.math_dtype
    weight_mm = weight.detach().to(options.matmul_dtype)  # (V, H); a copy only if dtypes differ
    bias_math = None if bias is None else bias.detach().to(math_dtype)  # (V,)
    chunk = max(1, min(options.chunk_tokens, rows))
    separate_ce = temperature != 1.0 and labels is not None  # CE needs untempered logits
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
    ce_weighted = hidden.new_zeros((), dtype=torch.float64)  # with ce_weights: sum of weight x CE

    for start in range(0, rows, chunk):
        end = min(start + chunk, rows)
        hidden_mm = hidden[start:end].detach().to(options.matmul_dtype)  # (c, H)
        logits = logits_buffer[: end - start]  # (c, V)
        _student_logits_(logits, hidden_mm, weight_mm, bias_math)
        targets = teacher.chunk(start, end, vocab, options)
        chunk_labels = None if labels is None else labels[start:end]  # (c,)
        ce_coef = None
        if chunk_labels is not None:
            row_weight = 1 - options.kd_weight if ce_weights is None else ce_weights[start:end].to(math_dtype)
            ce_coef = (chunk_labels != IGNORE_INDEX).to(math_dtype) * (row_weight / options.ce_count)
        if separate_ce:
            raw_logits = raw_buffer[: end - start]
            raw_logits.copy_(logits)
            logits.div_(temperature)
            kd_rows, _ = _partition_pass_(logits, targets, kd_coef, None, None, wants_grad)
            _, ce_rows = _partition_pass_(raw_logits, targets, 0.0, ce_coef, chunk_labels, wants_grad)
            if wants_grad:
                logits.add_(raw_logits)
        else:
            if temperature != 1.0:
                logits.div_(temperature)
            kd_rows, ce_rows = _partition_pass_(logits, targets, kd_coef, ce_coef, chunk_labels, wants_grad)
        kd_sum += kd_rows.sum(dtype=torch.float64)
        if ce_rows is not None:
            ce_sum += torch.where(chunk_labels != IGNORE_INDEX, ce_rows, 0).sum(dtype=torch.float64)
            if ce_weights is not None:
                ce_weighted += (ce_rows * ce_coef).sum(dtype=torch.float64)  # ce_coef: 0 without a label
        if wants_grad:  # `logits` now holds d loss / d logits for the chunk, (c, V)
            _accumulate_grads_(logits, hidden_mm, weight_mm, start, end,
                               grad_hidden, grad_weight, grad_bias, options.matmul_dtype)

    kd_mean = kd_sum * temperature**2 / options.kd_count
    ce_mean = ce_sum / options.ce_count
    ce_term = (1 - options.kd_weight) * ce_mean if ce_weights is None else ce_weighted
    loss = options.kd_weight * kd_mean + ce_term
    grads = [
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    ]
    return loss.to(math_dtype), kd_mean.to(math_dtype), ce_mean.to(math_dtype), grads


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


def _remove_head_(logits: Tensor, teacher: TeacherChunk) -> None:
    """Set the exact ids' entries of logits (c, V) to -inf so that what remains is the tail bucket."""
    if not teacher.has_folded_ids:
        logits.scatter_(1, teacher.ids, float("-inf"))
        return
    # Placeholders point at column 0: restore it unless 0 is a real exact id.
    column_zero = logits[:, 0].clone()
    logits.scatter_(1, teacher.ids, float("-inf"))
    zero_in_head = ((teacher.ids == 0) & teacher.valid).any(1)
    logits[:, 0] = torch.where(zero_in_head, float("-inf"), column_zero)


def _partition_pass_(
    logits: Tensor, teacher: TeacherChunk, kd_coef: float, ce_coef: Tensor | None,
    labels: Tensor | None, wants_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Per-row KD (and CE if labels) for logits (c, V); overwrites logits with d loss / d logits.

    The gradient is kd_coef * dKD + ce_coef * dCE per row. With the tail softmax e_j = exp(z_j - lse_tail),
    the teacher's term gives dKD/dz on the exact ids, a factor of e_j on the tail and, if it reads tail
    logits, an addend on those; dCE/dz_j = q_j - [j = label], with q_j = e_j q_o on the tail. Working from
    the tail softmax keeps every factor bounded even when q_o underflows.
    """
    z_head = logits.gather(1, teacher.ids).masked_fill(~teacher.valid, float("-inf"))  # (c, K)
    tail_logits = None if teacher.tail_ids is None else logits.gather(1, teacher.tail_ids)  # (c, S)
    label_logits = None
    if labels is not None:
        safe_labels = labels.clamp_min(0)[:, None]  # (c, 1)
        label_logits = logits.gather(1, safe_labels).squeeze(1)  # (c,)
    _remove_head_(logits, teacher)
    shift = logits.amax(1, keepdim=True)  # (c, 1); -inf for an empty tail
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    tail_exp = logits.sub_(shift).exp_()  # (c, V), exp(z_j - shift) on the tail, 0 on the exact ids
    tail_sum = tail_exp.sum(1)  # (c,)
    lse_tail = shift.squeeze(1) + tail_sum.log()  # (c,)
    lse = torch.logaddexp(lse_tail, z_head.logsumexp(1)) if z_head.shape[1] else lse_tail  # (c,) over V
    log_q_head, log_q_tail = z_head - lse[:, None], lse_tail - lse  # (c, K), (c,)
    q_head, q_tail = (log_q_head.exp(), log_q_tail.exp()) if wants_grad else (None, None)
    term = teacher.kd_term(StudentChunk(log_q_head, log_q_tail, lse_tail, tail_logits, q_head, q_tail), wants_grad)
    ce_rows = None if label_logits is None else lse - label_logits
    if not wants_grad:
        return term.rows, ce_rows

    tail_coef = kd_coef * term.tail  # (c,)
    head_grad = kd_coef * term.head  # (c, K)
    if ce_coef is not None:
        tail_coef = tail_coef + ce_coef * q_tail
        head_grad = head_grad + ce_coef[:, None] * q_head
    tail_scale = torch.where(tail_sum > 0, tail_coef / tail_sum, 0.0)  # exp(z - shift) -> e_j
    logits.mul_(tail_scale[:, None])
    logits.scatter_add_(1, teacher.ids, head_grad.masked_fill(~teacher.valid, 0.0))
    if term.tail_ids is not None:
        logits.scatter_add_(1, teacher.tail_ids, kd_coef * term.tail_ids)
    if labels is not None:
        logits.scatter_add_(1, safe_labels, -ce_coef[:, None])
    return term.rows, ce_rows


def check_student_inputs(hidden: Tensor, weight: Tensor, bias: Tensor | None, mask: Tensor | None,
                         labels: Tensor | None) -> None:
    """One-line ValueErrors for the student's side: shapes, dtypes and devices (the teacher's: its loss)."""
    if hidden.ndim != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float (N, H) tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    rows, width = hidden.shape
    if weight.ndim != 2 or weight.shape[1] != width or not weight.is_floating_point():
        raise ValueError(f"weight must be a float (V, {width}) tensor, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float ({weight.shape[0]},) tensor, "
                         f"got {bias.dtype} {tuple(bias.shape)}")
    if mask is not None and (mask.shape != (rows,) or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool ({rows},) tensor, got {mask.dtype} {tuple(mask.shape)}")
    if labels is not None and (labels.shape != (rows,) or labels.is_floating_point()
                               or labels.dtype == torch.bool):
        raise ValueError(f"labels must be an integer ({rows},) tensor, "
                         f"got {labels.dtype} {tuple(labels.shape)}")
    for name, tensor in {"weight": weight, "bias": bias, "mask": mask, "labels": labels}.items():
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")


def check_options(kd_weight: float, chunk_tokens: int, labels: Tensor | None) -> None:
    if not 0.0 <= kd_weight <= 1.0:
        raise ValueError(f"kd_weight must be in [0, 1], got {kd_weight}")
    if kd_weight < 1.0 and labels is None:
        raise ValueError(f"labels are required when kd_weight < 1 (got kd_weight={kd_weight})")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def check_labels(labels: Tensor, vocab: int) -> None:
    bad = ((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))).sum()
    if int(bad):
        raise ValueError(f"labels has {int(bad)} ids outside [0, {vocab}) that are not {IGNORE_INDEX}")
