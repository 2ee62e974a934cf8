"""A dense reference for fused_topk_kl written here (full logits, log_softmax, gather, autograd, float64),
random cases, and the check that the fused loss and its gradients match the reference.

At a temperature T != 1 the reference softens the teacher's **full** distribution (softmax of its
full-vocabulary log-probs / T) and sums its tail by masking, never from the stored tail's mass; the fused loss
gets what a store would hold for T (`tempered_tail`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kdflow.tasks.student.losses import fused_topk_kl


def dense_reference(
    hidden: Tensor, weight: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, *,
    bias: Tensor | None = None, mask: Tensor | None = None, labels: Tensor | None = None,
    kd_weight: float = 1.0, temperature: float = 1.0,
    counts: tuple[float, float] | None = None, tail_logprob: Tensor | None = None,
    teacher_log_p: Tensor | None = None,
) -> Tensor:
    """The K+1 bucket KL with every (N, V) tensor materialised, in float64. The tail bucket's teacher mass is
    exp(tail_logprob) plus the mass of ids beyond the student's vocabulary when given, else 1 - sum; padding
    (id < 0, log-prob -inf) is no entry at all. At T != 1 the teacher's buckets are those of
    softmax(teacher_log_p / T) over the teacher's whole vocabulary (N, V_teacher), required then."""
    logits = hidden.double() @ weight.double().T  # (N, V)
    if bias is not None:
        logits = logits + bias.double()
    rows, vocab = logits.shape
    ids = topk_ids.long()
    in_vocab = (ids < vocab) & (ids >= 0)
    gather_ids = ids.clamp(min=0, max=vocab - 1)
    teacher_top = torch.where(in_vocab, topk_logprobs.double().exp(), 0.0)  # (N, K)
    in_top_k = torch.zeros(rows, vocab, dtype=torch.bool)
    in_top_k[torch.arange(rows)[:, None].expand_as(ids)[in_vocab], ids[in_vocab]] = True
    tail_empty = in_top_k.all(1)
    if tail_logprob is None:
        teacher_tail = (1 - teacher_top.sum(1)).clamp_min(0)  # (N,)
    else:
        teacher_tail = tail_logprob.double().exp() + torch.where(in_vocab, 0.0, topk_logprobs.double().exp()).sum(1)
    teacher_tail = torch.where(tail_empty, 0.0, teacher_tail)
    if temperature != 1.0:
        tempered = torch.softmax(teacher_log_p.double() / temperature, dim=1)  # (N, V_teacher)
        teacher_top = torch.where(in_vocab, tempered.gather(1, ids.clamp(min=0)), 0.0)  # (N, K)
        teacher_tail = torch.where(tail_empty, 0.0, 1.0 - teacher_top.sum(1))
        rest = tempered.clone()  # the tail summed term by term as well: the two must agree
        rest[torch.arange(rows)[:, None].expand_as(ids)[in_vocab], ids[in_vocab]] = 0.0
        torch.testing.assert_close(torch.where(tail_empty, 0.0, rest.sum(1)), teacher_tail, rtol=1e-9, atol=1e-12)

    log_q = torch.log_softmax(logits / temperature, dim=1)  # (N, V)
    log_q_top = log_q.gather(1, gather_ids)
    tail_log_q = log_q.masked_fill(in_top_k, float("-inf"))
    tail_log_q = tail_log_q.masked_fill(tail_empty[:, None], 0.0)  # unused rows, keeps grads finite
    log_q_tail = tail_log_q.logsumexp(1)
    kd = (torch.xlogy(teacher_top, teacher_top) - teacher_top * log_q_top).sum(1)
    kd = kd + torch.xlogy(teacher_tail, teacher_tail) - teacher_tail * log_q_tail
    mass = teacher_top.sum(1) + teacher_tail  # 1 but for rounding: KL >= s log s (log-sum inequality)
    kd = (kd - torch.xlogy(mass, mass)) * temperature**2

    counted = torch.ones(rows, dtype=torch.bool) if mask is None else mask
    n_kd = counts[0] if counts else float(counted.sum())
    kd_mean = torch.where(counted, kd, 0.0).sum() / max(n_kd, 1)
    if labels is None:
        return kd_mean
    labels = torch.where(counted, labels, -100)
    n_ce = counts[1] if counts else float((labels != -100).sum())
    ce_sum = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return kd_weight * kd_mean + (1 - kd_weight) * ce_sum / max(n_ce, 1)


def make_case(rows: int, vocab: int, width: int, top_k: int, seed: int = 0, teacher_vocab: int | None = None,
              sharpness: float = 2.0) -> dict[str, Tensor]:
    """Random student + a teacher whose top-K log-probs are normalised over teacher_vocab."""
    gen = torch.Generator().manual_seed(seed)
    teacher_vocab = teacher_vocab or vocab
    teacher_logits = torch.randn(rows, teacher_vocab, generator=gen) * sharpness
    full = torch.log_softmax(teacher_logits, 1)
    logprobs, ids = full.topk(top_k, dim=1)  # sorted descending
    tail_logprob = full.double().scatter(1, ids, float("-inf")).logsumexp(1).float()  # exact, as v2 stores it
    return {
        "teacher_log_p": full,  # (rows, teacher_vocab)
        "hidden": torch.randn(rows, width, generator=gen, requires_grad=True),
        "weight": (torch.randn(vocab, width, generator=gen) / width**0.5).requires_grad_(),
        "bias": (torch.randn(vocab, generator=gen) * 0.1).requires_grad_(),
        "topk_ids": ids.to(torch.int32),
        "topk_logprobs": logprobs,
        "tail_logprob": tail_logprob,
        "labels": torch.randint(0, vocab, (rows,), generator=gen),
        "mask": torch.rand(rows, generator=gen) > 0.3,
    }


def tempered_tail(teacher_log_p: Tensor, topk_ids: Tensor, temperature: float) -> Tensor:
    """What a store holds for temperature T: per row log sum_{j outside the top-K} exp(l_j / T), in float64
    from the full log-probs (N, V_teacher); padding ids (< 0) are no entry."""
    ids = topk_ids.long()
    scaled = teacher_log_p.double() / temperature
    kept = torch.zeros_like(scaled, dtype=torch.bool)
    kept[torch.arange(ids.shape[0])[:, None].expand_as(ids)[ids >= 0], ids[ids >= 0]] = True
    return scaled.masked_fill(kept, float("-inf")).logsumexp(1).float()


def loss_and_grads(fn, case: dict[str, Tensor], **kwargs) -> tuple[Tensor, list[Tensor]]:
    params = [case["hidden"], case["weight"], case["bias"]]
    for p in params:
        p.grad = None
    loss = fn(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"],
              bias=case["bias"], **kwargs)
    loss.backward()
    return loss.detach().double(), [p.grad.clone() for p in params]


def assert_matches_reference(case: dict[str, Tensor], atol: float = 1e-5, **kwargs) -> Tensor:
    fused_kwargs = dict(kwargs)
    if "counts" in fused_kwargs:
        fused_kwargs["global_counts"] = fused_kwargs.pop("counts")
    temperature = kwargs.get("temperature", 1.0)
    if temperature != 1.0 and "tail_tempered" not in fused_kwargs:
        fused_kwargs["tail_tempered"] = tempered_tail(case["teacher_log_p"], case["topk_ids"], temperature)
    loss, grads = loss_and_grads(fused_topk_kl, case, **fused_kwargs)
    reference_kwargs = {key: value for key, value in kwargs.items() if key not in ("chunk_tokens", "tail_tempered")}
    if temperature != 1.0:
        reference_kwargs["teacher_log_p"] = case["teacher_log_p"]
    ref_loss, ref_grads = loss_and_grads(dense_reference, case, **reference_kwargs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=atol)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m, n=name: f"grad {n}: {m}")
    return loss
