"""fused_topk_kl against a dense reference (tests/support/losses.py: full logits, log_softmax, gather, autograd).

Memory, a golden value, bad input and v2 stores: test_losses_inputs.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.losses import assert_matches_reference, dense_reference, loss_and_grads, make_case

from kdflow.tasks.student.losses import fused_topk_kl


@pytest.mark.parametrize(
    ("rows", "vocab", "width", "top_k", "chunk_tokens"),
    [(1, 50, 8, 4, 1), (7, 50, 8, 1, 3), (37, 64, 16, 8, 16), (130, 97, 12, 20, 64), (37, 31, 8, 31, 5)],
)
def test_matches_dense_reference_over_shapes(rows, vocab, width, top_k, chunk_tokens) -> None:
    assert_matches_reference(make_case(rows, vocab, width, top_k), chunk_tokens=chunk_tokens)


def test_mask_labels_and_mixed_weight_match_reference() -> None:
    case = make_case(37, 64, 16, 8, seed=1)
    labels = case["labels"].clone()
    labels[::5] = -100
    assert_matches_reference(case, chunk_tokens=10, mask=case["mask"], labels=labels, kd_weight=0.3)
    assert_matches_reference(case, chunk_tokens=10, labels=labels, kd_weight=0.0)


def test_all_positions_ignored_gives_zero_loss_and_zero_grads() -> None:
    case = make_case(7, 50, 8, 4)
    for kwargs in ({"mask": torch.zeros(7, dtype=torch.bool), "labels": case["labels"], "kd_weight": 0.5},
                   {"labels": torch.full((7,), -100), "kd_weight": 0.0}):
        loss, grads = loss_and_grads(fused_topk_kl, case, **kwargs)
        assert loss.item() == 0.0
        for grad in grads:
            assert torch.isfinite(grad).all() and not grad.any()


def test_tail_near_zero_and_near_one_match_reference() -> None:
    one_hot = make_case(37, 64, 16, 8, seed=2, sharpness=40.0)  # teacher nearly one-hot
    assert one_hot["topk_logprobs"].exp().sum(1).min() > 1 - 1e-6
    assert_matches_reference(one_hot, chunk_tokens=16)
    flat = make_case(37, 64, 16, 8, seed=3, teacher_vocab=5000, sharpness=0.1)  # almost all mass in the tail
    assert flat["topk_logprobs"].exp().sum(1).max() < 0.01
    # Distinct ids inside the student's vocabulary, so that the tail mass does not fold.
    flat["topk_ids"] = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(r))[:8]
                                    for r in range(37)]).to(torch.int32)
    assert_matches_reference(flat, chunk_tokens=16)


def test_full_vocabulary_top_k_equals_full_kl() -> None:
    case = make_case(37, 40, 8, 40, seed=4)  # K = V: the tail bucket is empty
    loss = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"],
                         bias=case["bias"], chunk_tokens=9)
    logits = (case["hidden"] @ case["weight"].T + case["bias"]).double()
    teacher = torch.full((37, 40), float("-inf"), dtype=torch.float64)
    teacher.scatter_(1, case["topk_ids"].long(), case["topk_logprobs"].double())
    full_kl = F.kl_div(torch.log_softmax(logits, 1), teacher, log_target=True, reduction="batchmean")
    torch.testing.assert_close(loss.double(), full_kl, rtol=1e-5, atol=1e-6)
    assert_matches_reference(case, chunk_tokens=9)


def test_top_k_logit_gradient_equals_full_kl_gradient() -> None:
    """With weight = I the hidden states are the logits, so grad(hidden) is d loss / d logits."""
    rows, vocab, top_k = 6, 30, 5
    gen = torch.Generator().manual_seed(5)
    teacher_log_p = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 2, 1)  # (N, V)
    topk_logprobs, topk_ids = teacher_log_p.topk(top_k, dim=1)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)

    student = logits.clone().requires_grad_()
    fused_topk_kl(student, torch.eye(vocab, dtype=torch.float64), topk_ids, topk_logprobs).backward()
    bucket_grad = student.grad.gather(1, topk_ids)

    full = logits.clone().requires_grad_()
    full_kl = F.kl_div(torch.log_softmax(full, 1), teacher_log_p.double(), log_target=True,
                       reduction="batchmean")
    full_kl.backward()
    torch.testing.assert_close(bucket_grad, full.grad.gather(1, topk_ids), rtol=1e-6, atol=1e-9)

    # Renormalising the teacher over its top-K (no tail bucket) does not have this property.
    renormalised = torch.log_softmax(topk_logprobs.double(), 1)
    naive = logits.clone().requires_grad_()
    naive_log_q_top = torch.log_softmax(naive, 1).gather(1, topk_ids)
    naive_kl = (renormalised.exp() * (renormalised - naive_log_q_top)).sum() / rows
    naive_kl.backward()
    assert (naive.grad.gather(1, topk_ids) - full.grad.gather(1, topk_ids)).abs().max() > 1e-2


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_matches_reference(temperature: float) -> None:
    case = make_case(37, 64, 16, 8, seed=6)
    assert_matches_reference(case, chunk_tokens=16, temperature=temperature)
    assert_matches_reference(case, chunk_tokens=16, temperature=temperature, labels=case["labels"],
                             kd_weight=0.6, mask=case["mask"])


def test_global_counts_halves_sum_to_whole_batch() -> None:
    case = make_case(37, 64, 16, 8, seed=7)
    labels = case["labels"].clone()
    labels[::4] = -100
    options = {"labels": labels, "kd_weight": 0.7, "mask": case["mask"]}
    whole, whole_grads = loss_and_grads(fused_topk_kl, case, chunk_tokens=8, **options)
    counts = (int(case["mask"].sum()), int((case["mask"] & (labels != -100)).sum()))
    halves = [slice(0, 20), slice(20, 37)]
    total, grads = torch.zeros((), dtype=torch.float64), [torch.zeros_like(g) for g in whole_grads[1:]]
    grad_hidden = torch.zeros_like(whole_grads[0])
    for half in halves:
        hidden = case["hidden"].detach()[half].clone().requires_grad_()
        case["weight"].grad = case["bias"].grad = None
        loss = fused_topk_kl(hidden, case["weight"], case["topk_ids"][half], case["topk_logprobs"][half],
                             bias=case["bias"], labels=labels[half], kd_weight=0.7, mask=case["mask"][half],
                             global_counts=counts, chunk_tokens=8)
        loss.backward()
        total += loss.double()
        grad_hidden[half] = hidden.grad
        grads = [g + p.grad for g, p in zip(grads, (case["weight"], case["bias"]))]
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)
    for got, want in zip([grad_hidden, *grads], whole_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_teacher_ids_beyond_student_vocabulary_fold_into_tail() -> None:
    case = make_case(37, 64, 16, 8, seed=8, teacher_vocab=80)  # teacher vocabulary larger than student's
    folded = int((case["topk_ids"] >= 64).sum())
    assert folded > 0 and (case["topk_ids"] == 0).any()  # id 0 also appears as a real top-K id
    with pytest.warns(UserWarning, match=f"{folded} teacher top-K ids are >= the student's vocabulary"):
        assert_matches_reference(case, chunk_tokens=16, labels=case["labels"], kd_weight=0.5)


def test_float16_logprobs_and_no_gradient_to_teacher() -> None:
    case = make_case(37, 64, 16, 8, seed=9)
    case["topk_logprobs"] = case["topk_logprobs"].half()
    assert_matches_reference(case, chunk_tokens=16)
    teacher = case["topk_logprobs"].clone().requires_grad_()
    loss = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], teacher)
    loss.backward()
    assert teacher.grad is None and case["hidden"].grad is not None


def test_parts_no_grad_and_bfloat16_autocast() -> None:
    case = make_case(37, 64, 16, 8, seed=10)
    args = (case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"])
    loss, kd, ce = fused_topk_kl(*args, labels=case["labels"], kd_weight=0.25, return_parts=True)
    torch.testing.assert_close(loss, 0.25 * kd + 0.75 * ce)
    assert not kd.requires_grad and not ce.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(fused_topk_kl(*args, labels=case["labels"], kd_weight=0.25), loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = fused_topk_kl(*args, chunk_tokens=16)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, fused_topk_kl(*args), rtol=2e-2, atol=2e-2)
    low.backward()
    assert case["hidden"].grad.dtype == torch.float32 and torch.isfinite(case["weight"].grad).all()


# bfloat16 keeps 8 significant bits: one rounding of a gradient is up to 2^-9 of its size. The fused loss's
# bfloat16 gradients may differ from the exact ones by at most 2^-6 of the largest gradient (measured: <= 2^-8
# over 30 cases of seeds 11-20), so a wrong term (a gradient 5% off) fails.
BF16_GRAD_BOUND = 2.0**-6


@pytest.mark.parametrize(("rows", "vocab", "width", "top_k", "chunk_tokens"), [(7, 50, 8, 4, None),
                                                                              (130, 97, 12, 20, 16)])
def test_bfloat16_inputs_give_bfloat16_grads_close_to_the_exact_ones(rows, vocab, width, top_k, chunk_tokens) -> None:
    case = make_case(rows, vocab, width, top_k, seed=11)
    hidden = case["hidden"].detach().bfloat16().requires_grad_()
    weight = case["weight"].detach().bfloat16().requires_grad_()
    kwargs = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    loss = fused_topk_kl(hidden, weight, case["topk_ids"], case["topk_logprobs"], **kwargs)
    loss.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    # The reference: the dense K+1 loss in float64 on the same (bfloat16-rounded) inputs.
    exact_hidden = hidden.detach().double().requires_grad_()
    exact_weight = weight.detach().double().requires_grad_()
    exact = dense_reference(exact_hidden, exact_weight, case["topk_ids"], case["topk_logprobs"])
    exact.backward()
    assert abs(loss.item() - exact.item()) <= BF16_GRAD_BOUND * abs(exact.item())
    for got, want in ((hidden.grad, exact_hidden.grad), (weight.grad, exact_weight.grad)):
        assert (got.double() - want).abs().max() <= BF16_GRAD_BOUND * want.abs().max()
        assert (got.double() * 1.05 - want).abs().max() > BF16_GRAD_BOUND * want.abs().max()  # the bound can fail


def test_a_student_equal_to_a_quantised_teacher_has_zero_kd_not_below_it() -> None:
    """Stored top-K values are rounded (v2: sqrt(p) to 400 levels), so the K+1 masses sum to s != 1; the K+1 sum
    alone then fell below 0 by up to |s - 1| for a student equal to the teacher (a held-out "KL" of -0.0001 from a
    random teacher). KD less s log s is >= 0; the gradients are those of the plain K+1 sum (a constant apart)."""
    rows, vocab, top_k = 9, 40, 6
    teacher_logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 0.2  # near uniform
    full = torch.log_softmax(teacher_logits, 1)
    logprobs, ids = full.topk(top_k, dim=1)
    rounded = 2 * torch.log(torch.round(logprobs.exp().sqrt() * 400) / 400)  # the store's sqrt/400 values
    tail = full.double().scatter(1, ids, float("-inf")).logsumexp(1).float()
    mass = rounded.double().exp().sum(1) + tail.double().exp()
    assert (mass - 1).abs().max() > 1e-4  # the rounding bites
    case = {"hidden": full.clone().requires_grad_(), "weight": torch.eye(vocab).requires_grad_(),  # q = softmax(full)
            "bias": torch.zeros(vocab, requires_grad=True), "topk_ids": ids.to(torch.int32), "topk_logprobs": rounded,
            "tail_logprob": tail}
    kd = assert_matches_reference(case, chunk_tokens=4, tail_logprob=tail)
    assert 0 <= kd.item() < 1e-5
    raw = (rounded.double().exp() * (rounded.double() - full.gather(1, ids).double())).sum(1)  # p_o log(p_o/q_o) = 0
    assert raw.min() < -1e-5  # what the K+1 sum alone gave on some rows
