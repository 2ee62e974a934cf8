"""The loss on masked stores and on top_k (renormalised) stores against dense references written here: full
logits, log_softmax, the teacher renormalised over its K ids, autograd in float64.

KD counts only positions with a target; cross-entropy weighs 1 - kd_weight where there is one and
student.kd.untargeted_ce_weight where there is none; the renormalised-K loss fits the student's softmax restricted
to the teacher's K ids and reads no tail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.losses import dense_reference, make_case

from kdflow.tasks.student.losses import fused_topk_kl


def renormalised_reference(case: dict, target: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                           kd_weight: float = 1.0, untargeted_ce_weight: float = 0.0,
                           temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher over its valid K ids, renormalised || student's softmax over the same ids), T^2-scaled, mean
    over targeted positions; plus per-position weighted cross-entropy over labelled positions."""
    logits = case["hidden"].double() @ case["weight"].double().T + case["bias"].double()
    rows, vocab = logits.shape
    ids = case["topk_ids"].long()
    valid = (ids >= 0) & (ids < vocab)
    teacher = (case["topk_logprobs"].double() / temperature).masked_fill(~valid, float("-inf"))
    student = (logits / temperature).gather(1, ids.clamp(0, vocab - 1)).masked_fill(~valid, float("-inf"))
    kd = torch.zeros(rows, dtype=torch.float64)
    for r in range(rows):  # one position at a time, only its valid ids
        if valid[r].any():
            p_log = torch.log_softmax(teacher[r][valid[r]], 0)
            r_log = torch.log_softmax(student[r][valid[r]], 0)
            kd[r] = (p_log.exp() * (p_log - r_log)).sum() * temperature**2
    targeted = torch.ones(rows, dtype=torch.bool) if target is None else target
    kd_mean = kd[targeted].sum() / max(int(targeted.sum()), 1)
    if labels is None:
        return kd_mean
    return kd_weight * kd_mean + weighted_ce(logits, labels, targeted, kd_weight, untargeted_ce_weight)


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, targeted: torch.Tensor, kd_weight: float,
                untargeted_ce_weight: float) -> torch.Tensor:
    ce = F.cross_entropy(logits.double(), labels, ignore_index=-100, reduction="none")
    weights = torch.where(targeted, 1.0 - kd_weight, untargeted_ce_weight).double()
    return (weights * ce).sum() / max(int((labels != -100).sum()), 1)


def fused_and_grads(case: dict, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [case["hidden"], case["weight"], case["bias"]]
    for param in params:
        param.grad = None
    loss = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"], bias=case["bias"],
                         **kwargs)
    loss.backward()
    return loss.detach().double(), [param.grad.clone() for param in params]


def reference_and_grads(case: dict, reference, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [case["hidden"], case["weight"], case["bias"]]
    for param in params:
        param.grad = None
    loss = reference(case, **kwargs)
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in params]


def assert_close(fused: tuple, reference: tuple) -> None:
    torch.testing.assert_close(fused[0], reference[0], atol=1e-5, rtol=1e-5)
    for got, want in zip(fused[1], reference[1], strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-4)


def renormalised_case(seed: int, rows: int = 29, vocab: int = 61, top_k: int = 6) -> dict:
    case = make_case(rows, vocab, 12, top_k, seed=seed)
    case["topk_logprobs"] = torch.log_softmax(case["topk_logprobs"], 1)  # a top_k store: sums to 1 over the K
    return case


@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
def test_renormalised_loss_matches_dense_reference(chunk_tokens: int) -> None:
    case = renormalised_case(0)
    fused = fused_and_grads(case, normalisation="top_k", chunk_tokens=chunk_tokens)
    assert_close(fused, reference_and_grads(case, renormalised_reference))
    assert fused[0] > 0


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_renormalised_loss_is_exact_at_a_temperature(temperature: float) -> None:
    case = renormalised_case(1)
    fused = fused_and_grads(case, normalisation="top_k", temperature=temperature, chunk_tokens=8)
    assert_close(fused, reference_and_grads(case, renormalised_reference, temperature=temperature))


def test_renormalised_loss_with_mask_padding_and_weighted_ce() -> None:
    case = renormalised_case(2)
    target = torch.rand(29, generator=torch.Generator().manual_seed(5)) > 0.4
    case["topk_ids"][3, 4:] = -1  # adaptive-K padding inside a targeted position
    case["topk_logprobs"][3, 4:] = float("-inf")
    case["topk_ids"][~target] = 7  # anything at positions without a target: ignored
    labels = case["labels"].clone()
    labels[::6] = -100
    options = {"target": target, "labels": labels, "kd_weight": 0.7, "untargeted_ce_weight": 0.2}
    fused = fused_and_grads(case, normalisation="top_k", chunk_tokens=5, **options)
    assert_close(fused, reference_and_grads(case, renormalised_reference, **options))


def test_renormalised_loss_never_reads_the_tail() -> None:
    case = renormalised_case(3)
    without = fused_and_grads(case, normalisation="top_k")
    nan_tail = fused_and_grads(case, normalisation="top_k", tail_logprob=torch.full((29,), float("nan")))
    assert_close(nan_tail, without)


def masked_reference(case: dict, target: torch.Tensor, labels: torch.Tensor, kd_weight: float,
                     untargeted_ce_weight: float) -> torch.Tensor:
    kd = dense_reference(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"], bias=case["bias"],
                         mask=target, tail_logprob=case["tail_logprob"])
    logits = case["hidden"].double() @ case["weight"].double().T + case["bias"].double()
    return kd_weight * kd + weighted_ce(logits, labels, target, kd_weight, untargeted_ce_weight)


@pytest.mark.parametrize(("kd_weight", "untargeted"), [(1.0, 0.0), (0.6, 0.0), (0.6, 0.3), (1.0, 1.0)])
def test_masked_k_plus_one_loss_equals_the_reference_over_targeted_positions(kd_weight: float,
                                                                             untargeted: float) -> None:
    case = make_case(33, 57, 10, 5, seed=4)
    target = torch.rand(33, generator=torch.Generator().manual_seed(6)) > 0.35
    target[:3] = False  # an untargeted run at the start, as a prompt
    case["topk_logprobs"][~target] = 0.0  # garbage where there is no target: must not count
    case["tail_logprob"][~target] = float("nan")
    labels = case["labels"].clone()
    labels[-1] = -100
    options = {"target": target, "labels": labels, "kd_weight": kd_weight, "untargeted_ce_weight": untargeted}
    fused = fused_and_grads(case, tail_logprob=case["tail_logprob"], chunk_tokens=6, **options)
    clean = dict(case, tail_logprob=case["tail_logprob"].nan_to_num(0.0))
    assert_close(fused, reference_and_grads(clean, lambda c, **kw: masked_reference(c, **kw), **options))


def test_an_all_untargeted_batch_has_zero_kd_and_only_the_weighted_ce() -> None:
    case = make_case(9, 40, 8, 4, seed=7)
    target = torch.zeros(9, dtype=torch.bool)
    loss, kd, ce = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"],
                                 bias=case["bias"], target=target, labels=case["labels"], kd_weight=1.0,
                                 untargeted_ce_weight=0.5, return_parts=True)
    assert kd.item() == 0.0
    torch.testing.assert_close(loss.detach(), 0.5 * ce, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalisation", ["full", "top_k"])
def test_ranks_with_global_counts_of_targeted_positions_sum_to_the_whole_batch(normalisation: str) -> None:
    case = renormalised_case(8) if normalisation == "top_k" else make_case(29, 61, 12, 6, seed=8)
    target = torch.rand(29, generator=torch.Generator().manual_seed(9)) > 0.5
    options = {"labels": case["labels"], "kd_weight": 0.8, "untargeted_ce_weight": 0.3,
               "normalisation": normalisation, "tail_logprob": case["tail_logprob"]}
    whole = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"], bias=case["bias"],
                          target=target, **options)
    counts = (float(target.sum()), float((case["labels"] != -100).sum()))  # what steps._counts all-reduces
    halves = sum(fused_topk_kl(case["hidden"][part], case["weight"], case["topk_ids"][part],
                               case["topk_logprobs"][part], bias=case["bias"], target=target[part],
                               global_counts=counts, **(options | {"labels": case["labels"][part],
                                                                   "tail_logprob": case["tail_logprob"][part]}))
                 for part in (slice(0, 13), slice(13, 29)))
    torch.testing.assert_close(halves, whole)
