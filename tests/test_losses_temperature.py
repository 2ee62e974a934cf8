"""fused_topk_kl at a temperature T != 1 against a dense tempered reference (tests/support/losses.py: the softmax
of the teacher's full-vocabulary log-probs / T and of the student's logits / T, autograd, float64).

The loss gets the teacher's tempered tail (log sum over the ids outside the top-K of exp(l_j / T)); the
reference never sees it. The diffuse-tail case is one where tempering the tail as one lump (p_o^(1/T), what
the loss did before) is far off, so these tests fail on that approximation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.losses import assert_matches_reference, make_case, tempered_tail

from kdflow.tasks.student.losses import fused_topk_kl


def diffuse_tail_case(rows: int, vocab: int, top_k: int, tail_mass: float, seed: int) -> dict[str, torch.Tensor]:
    """A teacher with `1 - tail_mass` on its top-K and `tail_mass` spread almost evenly over every other id."""
    case = make_case(rows, vocab, 16, top_k, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    head = torch.log_softmax(torch.randn(rows, top_k, generator=gen), 1) + torch.log(torch.tensor(1 - tail_mass))
    spread = torch.log_softmax(torch.randn(rows, vocab - top_k, generator=gen) * 0.1, 1)
    spread = spread + torch.log(torch.tensor(tail_mass))
    order = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])  # which ids hold the head
    full = torch.empty(rows, vocab).scatter_(1, order, torch.cat([head, spread], 1))
    logprobs, ids = full.topk(top_k, dim=1)
    tail = full.double().scatter(1, ids, float("-inf")).logsumexp(1).float()
    return dict(case, teacher_log_p=full, topk_ids=ids.to(torch.int32), topk_logprobs=logprobs, tail_logprob=tail)


@pytest.mark.parametrize("temperature", [0.5, 2.0, 4.0])
def test_diffuse_tail_matches_dense_tempered_reference(temperature: float) -> None:
    case = diffuse_tail_case(23, 3000, 4, tail_mass=0.1, seed=30)
    assert_matches_reference(case, chunk_tokens=8, temperature=temperature, tail_logprob=case["tail_logprob"])
    assert_matches_reference(case, chunk_tokens=7, temperature=temperature, tail_logprob=case["tail_logprob"],
                             labels=case["labels"], kd_weight=0.7, mask=case["mask"])


def test_diffuse_tail_is_where_one_lump_is_far_off() -> None:
    """At T = 2 a tail of 0.1 over ~3000 ids holds most of the tempered mass; one lump p_o^(1/T) gives it
    little. The loss with the lump's tail (log p_o / T) is far from the reference; with the stored tail exact."""
    case = diffuse_tail_case(23, 3000, 4, tail_mass=0.1, seed=31)
    tempered = torch.softmax(case["teacher_log_p"].double() / 2.0, 1)
    tail_share = 1 - tempered.gather(1, case["topk_ids"].long()).sum(1)
    lump = torch.cat([case["topk_logprobs"].double(), case["tail_logprob"].double()[:, None]], 1) / 2.0
    lump_share = lump.softmax(1)[:, -1]
    assert tail_share.min() > 0.85 and lump_share.max() < 0.3
    exact = assert_matches_reference(case, chunk_tokens=8, temperature=2.0)
    args = (case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"])
    as_lump = fused_topk_kl(*args, bias=case["bias"], temperature=2.0, tail_tempered=case["tail_logprob"] / 2.0)
    assert abs(as_lump.item() - exact.item()) > 0.2 * exact.item()


@pytest.mark.parametrize("temperature", [0.5, 3.0])
def test_top_k_logit_gradient_is_the_full_tempered_kl_gradient(temperature: float) -> None:
    """With weight = I the hidden states are the logits. On the top-K logits the K+1-bucket KL's gradient equals
    that of T^2 KL(softmax(teacher / T) || softmax(logits / T)) over the whole vocabulary, tail diffuse or not."""
    case = diffuse_tail_case(6, 400, 5, tail_mass=0.3, seed=32)
    gen = torch.Generator().manual_seed(33)
    logits = torch.randn(6, 400, generator=gen, dtype=torch.float64)
    ids = case["topk_ids"]
    student = logits.clone().requires_grad_()
    fused_topk_kl(student, torch.eye(400, dtype=torch.float64), ids, case["topk_logprobs"], temperature=temperature,
                  tail_tempered=tempered_tail(case["teacher_log_p"], ids, temperature)).backward()
    full = logits.clone().requires_grad_()
    teacher = torch.log_softmax(case["teacher_log_p"].double() / temperature, 1)
    full_kl = F.kl_div(torch.log_softmax(full / temperature, 1), teacher, log_target=True, reduction="batchmean")
    (full_kl * temperature**2).backward()
    torch.testing.assert_close(student.grad.gather(1, ids.long()), full.grad.gather(1, ids.long()),
                               rtol=1e-6, atol=1e-9)
    tail_grad = student.grad.scatter(1, ids.long(), 0.0).sum(1)  # right in total on the tail
    torch.testing.assert_close(tail_grad, full.grad.scatter(1, ids.long(), 0.0).sum(1), rtol=1e-6, atol=1e-9)


def test_folded_ids_and_padding_at_a_temperature() -> None:
    """Teacher ids beyond the student's vocabulary join the tempered tail; adaptive-K padding is no entry."""
    wide = make_case(37, 64, 12, 8, seed=34, teacher_vocab=80)
    with pytest.warns(UserWarning, match="folded into the tail"):
        assert_matches_reference(wide, chunk_tokens=10, temperature=2.0, tail_logprob=wide["tail_logprob"])
    case = make_case(37, 64, 16, 8, seed=35)
    kept = torch.randint(1, 9, (37,), generator=torch.Generator().manual_seed(2))
    pad = torch.arange(8)[None, :] >= kept[:, None]
    padded = dict(case, topk_ids=case["topk_ids"].masked_fill(pad, -1),
                  topk_logprobs=case["topk_logprobs"].masked_fill(pad, float("-inf")))
    assert_matches_reference(padded, chunk_tokens=16, temperature=0.5)


def test_temperature_one_ignores_the_tempered_tail() -> None:
    case = make_case(17, 64, 16, 8, seed=36)
    args = (case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"])
    plain = fused_topk_kl(*args, tail_logprob=case["tail_logprob"])
    given = fused_topk_kl(*args, tail_logprob=case["tail_logprob"], tail_tempered=torch.zeros(17))
    assert plain.item() == given.item()
