"""The loss on sampled targets: unbiased over seeds (z-scores from the sample variance), the K+1 loss's tail
gradient provably not, and the fused chunked loss against a dense float64 reference written here."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from kdflow.schemas.sampled_settings import SCHEMES
from kdflow.tasks.common.sampled import SampledTargets, ht_weights, target_kind
from kdflow.tasks.student.losses import fused_topk_kl
from kdflow.tasks.student.sampled_loss import fused_sampled_kl
from kdflow.tasks.teacher.sampling import SamplingPlan, chunked_sampled

N, V, H = 8, 50, 16


def draw(logits: Tensor, plan: SamplingPlan, rows: Tensor | None = None, positions: Tensor | None = None,
         chunk_tokens: int = 4096) -> SampledTargets:
    """Targets of teacher logits (N, V) through the real pass (lm_head = identity, hidden = the logits)."""
    n, vocab = logits.shape
    rows = torch.zeros(n, dtype=torch.long) if rows is None else rows
    positions = torch.arange(n) if positions is None else positions
    return chunked_sampled(logits.float(), torch.eye(vocab), plan, chunk_tokens, shard=3, rows=rows,
                           positions=positions)


def z_bound(coordinates: int, alpha: float = 1e-4) -> float:
    """Two-sided Bonferroni bound: some |z| of `coordinates` exceeds it with probability <= alpha."""
    return NormalDist().inv_cdf(1 - alpha / (2 * max(coordinates, 1)))


def z_scores(draws: Tensor, exact: Tensor, fixed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """draws (R, ...) of an estimator and the exact value (...) -> z-scores of the random coordinates, and
    the standard errors. `fixed` marks coordinates the estimator gets exactly (the head): they must match."""
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    fixed = torch.zeros_like(exact, dtype=torch.bool) if fixed is None else fixed
    torch.testing.assert_close(mean[fixed], exact[fixed], rtol=1e-5, atol=1e-7)  # float32 stored log-probs
    assert bool((se[~fixed] > 0).all())
    return (mean[~fixed] - exact[~fixed]) / se[~fixed], se


def replicated(plan: SamplingPlan, replicas: int, seed: int = 0) -> tuple[Tensor, SampledTargets]:
    """A flat teacher (N, V) and its targets drawn `replicas` times: replica r is row r of the shard, which
    is another noise stream of the same positions, exactly as another seed is."""
    teacher = (torch.randn(N, V, generator=torch.Generator().manual_seed(seed)) * 0.8).double()
    targets = draw(teacher.repeat(replicas, 1), plan, torch.arange(replicas).repeat_interleave(N),
                   torch.arange(N).repeat(replicas))
    # The z-test is sound only once rare events were seen: every tail token drawn at least 30 times.
    counts = torch.zeros(N, V, dtype=torch.long)
    ids = targets.sample_ids.long().view(replicas, N, -1)
    for position in range(N):
        counts[position] = torch.bincount(ids[:, position].flatten(), minlength=V)
    counts.scatter_(1, targets.head_ids[:N].long(), 30)
    assert int(counts.min()) >= 30
    return teacher, targets


def exact_kl(teacher: Tensor, student: Tensor) -> tuple[Tensor, Tensor]:
    """KL(p || q) per row (N,) and its gradient w.r.t. the student logits (N, V), dense, float64."""
    log_p, log_q = torch.log_softmax(teacher, 1), torch.log_softmax(student, 1)
    return (log_p.exp() * (log_p - log_q)).sum(1), log_q.exp() - log_p.exp()


def through_default_codec(out: SampledTargets, replicas: int, scheme: str) -> SampledTargets:
    """The targets written and read back as a store keeps them: the default SampledCodec (head sqrt/400 levels,
    tail and sample log-probs float16), one row per replica of the N positions."""
    from kdflow.schemas.codec_sampled import DecodedSampled, SampledCodec, decode_sampled, encode_sampled

    codec = SampledCodec(N, out.head, out.samples, V, scheme=scheme)
    assert (codec.sample_values, codec.tail) == ("float16", "float16")
    arrays = DecodedSampled(*(t.reshape(replicas, N, *t.shape[1:]).numpy() for t in (
        out.head_ids, out.head_logprobs.float(), out.tail_logprob.float(), out.sample_ids,
        out.sample_logprobs.float(), out.log_threshold.float())))
    decoded = decode_sampled(encode_sampled(codec, arrays))
    back = SampledTargets(*(torch.from_numpy(a.reshape(replicas * N, *a.shape[2:])) for a in decoded))
    assert torch.equal(back.log_threshold, out.log_threshold.float())  # float32 on disk: bit for bit
    assert not torch.equal(back.sample_logprobs, out.sample_logprobs.float())  # rounded: float16 on disk
    return back


@pytest.mark.parametrize("stored", [False, True], ids=["as_computed", "default_codec"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_estimate_every_tail_probability_without_bias(scheme: str, stored: bool) -> None:
    replicas = 3000
    teacher, out = replicated(SamplingPlan(head=H, samples=6, scheme=scheme, seed=1), replicas)
    exact_tail = out.tail_logprob[:N].double().exp()  # as computed (float32), before any store
    if stored:
        out = through_default_codec(out, replicas, scheme)
    weights = ht_weights(out.sample_logprobs.double(), out.log_threshold.double(), scheme)  # (R * N, S)
    per_token = torch.zeros(replicas * N, V, dtype=torch.float64).scatter_add_(1, out.sample_ids.long(), weights)
    in_head = torch.zeros(N, V, dtype=torch.bool).scatter_(1, out.head_ids[:N].long(), True)
    p = torch.softmax(teacher.float().double(), 1)
    z, _ = z_scores(per_token.view(replicas, N, V), p.masked_fill(in_head, 0.0), fixed=in_head)
    assert z.abs().max() < z_bound(z.numel())
    z_mass, _ = z_scores(weights.sum(1).view(replicas, N), exact_tail)
    assert z_mass.abs().max() < z_bound(N)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("head", "samples", "replicas"), [(H, 6, 3000), (H, 2, 6000), (0, 12, 3000)])
def test_loss_and_logit_gradient_are_unbiased_and_the_top_k_loss_is_not(scheme: str, head: int, samples: int,
                                                                        replicas: int) -> None:
    teacher, out = replicated(SamplingPlan(head=head, samples=samples, scheme=scheme, seed=2), replicas)
    teacher = teacher.float().double()  # what the pass saw
    student = torch.randn(N, V, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    logits = student.repeat(replicas, 1).requires_grad_()  # lm_head = identity: hidden states are the logits
    loss, kd, _ = fused_sampled_kl(logits, torch.eye(V, dtype=torch.float64), out, scheme=scheme, chunk_tokens=1000,
                                   return_parts=True)
    loss.backward()
    grads = (logits.grad * (replicas * N)).view(replicas, N, V)  # per draw and position: dKD^/dz
    # Per-position losses from the gradient's linearity are not exposed; rerun per replica-block for them.
    rows = torch.stack([fused_sampled_kl(student, torch.eye(V, dtype=torch.float64),
                                         out.map(lambda t, r=r: t[r * N:(r + 1) * N]), scheme=scheme)
                        for r in range(0, replicas, 10)])  # (R / 10,) batch means over the N positions
    kl, kl_grad = exact_kl(teacher, student)
    in_head = torch.zeros(N, V, dtype=torch.bool).scatter_(1, torch.log_softmax(teacher, 1).topk(head, 1).indices, True)
    z_grad, se_grad = z_scores(grads, kl_grad, fixed=in_head)
    assert z_grad.abs().max() < z_bound(z_grad.numel())
    z_mean, _ = z_scores(rows, kl.mean())  # the batch mean, what training sees
    assert z_mean.abs().max() < z_bound(1)
    assert abs(float(kd) - float(kl.mean())) < 5 * float(rows.std()) / math.sqrt(replicas)  # all draws at once
    if not head:
        return
    # Today's K+1 loss on the same head: its tail gradient e_k (q_o - p_o) is not the KL's q_k - p_k ...
    head_ids = out.head_ids[:N]
    bucket_logits = student.clone().requires_grad_()
    fused_topk_kl(bucket_logits, torch.eye(V, dtype=torch.float64), head_ids, out.head_logprobs[:N].double()).backward()
    bucket_grad = bucket_logits.grad * N
    in_tail = ~in_head
    assert (bucket_grad - kl_grad)[in_tail].abs().max() > 1e-2
    # ... and the Monte-Carlo test above can tell them apart: the K+1 gradient fails it by far.
    bucket_z = (grads.mean(0) - bucket_grad)[in_tail] / se_grad[in_tail]
    assert bucket_z.abs().max() > 5 * z_bound(z_grad.numel())


def test_wrong_inclusion_probabilities_are_detected() -> None:
    """Gumbel samples weighted as priority samples: biased, and the same z-test says so."""
    replicas = 3000
    teacher, out = replicated(SamplingPlan(head=0, samples=6, scheme="gumbel", seed=3), replicas)
    student = torch.randn(N, V, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    rows = torch.stack([fused_sampled_kl(student, torch.eye(V, dtype=torch.float64),
                                         out.map(lambda t, r=r: t[r * N:(r + 1) * N]), scheme="priority")
                        for r in range(0, replicas, 10)])
    z, _ = z_scores(rows, exact_kl(teacher.float().double(), student)[0].mean())
    assert z.abs().max() > z_bound(1)


def test_hidden_weight_and_bias_gradients_are_unbiased_over_seeds() -> None:
    gen = torch.Generator().manual_seed(4)
    rows, vocab, width, seeds = 6, 30, 5, 400
    teacher = torch.randn(rows, vocab, generator=gen).double()
    hidden = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.3
    _, kl_grad = exact_kl(teacher, hidden @ weight.T + bias)
    exact = torch.cat([(kl_grad @ weight).flatten(), (kl_grad.T @ hidden).flatten(), kl_grad.sum(0)]) / rows
    draws = []
    for seed in range(seeds):
        out = draw(teacher, SamplingPlan(head=8, samples=5, seed=seed))
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        fused_sampled_kl(h, w, out, scheme="priority", bias=b, chunk_tokens=4).backward()
        draws.append(torch.cat([h.grad.flatten(), w.grad.flatten(), b.grad]))
    z, _ = z_scores(torch.stack(draws), exact)
    assert z.abs().max() < z_bound(z.numel())


def test_the_whole_tail_sampled_is_the_exact_kl() -> None:
    teacher = torch.randn(N, V, generator=torch.Generator().manual_seed(5)).double()
    student = torch.randn(N, V, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out = draw(teacher, SamplingPlan(head=20, samples=30, scheme="gumbel"))  # H + S = V: nothing is random
    assert bool(torch.isneginf(out.log_threshold).all())
    logits = student.clone().requires_grad_()
    loss = fused_sampled_kl(logits, torch.eye(V, dtype=torch.float64), out, scheme="gumbel", chunk_tokens=3)
    loss.backward()
    kl, kl_grad = exact_kl(teacher, student)
    torch.testing.assert_close(loss, kl.mean(), rtol=1e-6, atol=1e-6)  # float32 stored log-probs
    torch.testing.assert_close(logits.grad, kl_grad / N, rtol=1e-5, atol=1e-7)


# --- the fused chunked loss against a dense float64 reference ---------------------------------------------


def dense_reference(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: SampledTargets, scheme: str,
                    mask: Tensor | None = None, labels: Tensor | None = None, kd_weight: float = 1.0) -> Tensor:
    """The estimator with the full (N, V) log-softmax in float64, written from log q, autograd for gradients:
    sum_h p (l - log q) + p_o (log p_o - log q_o) + sum_s w [(l_s - log p_o) - (log q_s - log q_o)]."""
    logits = hidden.double() @ weight.double().T + (0.0 if bias is None else bias.double())
    log_q = torch.log_softmax(logits, 1)  # (N, V)
    rows, vocab = log_q.shape
    head_ids, sample_ids = targets.head_ids.long(), targets.sample_ids.long()
    head_ok, sample_ok = head_ids < vocab, sample_ids < vocab
    in_head = torch.zeros(rows, vocab + 1, dtype=torch.bool).scatter_(1, head_ids.clamp(max=vocab), True)[:, :vocab]
    log_p_head = targets.head_logprobs.double()
    folded = log_p_head.masked_fill(head_ok, -torch.inf).logsumexp(1) if head_ids.shape[1] else -torch.inf
    log_p_o = torch.logaddexp(targets.tail_logprob.double(), torch.as_tensor(folded, dtype=torch.float64))
    p_o = torch.where(in_head.all(1), 0.0, log_p_o.exp())
    log_q_o = log_q.masked_fill(in_head, -torch.inf).logsumexp(1)
    p_head = torch.where(head_ok, log_p_head.exp(), 0.0)
    kd = (p_head * (log_p_head - log_q.gather(1, head_ids.clamp(max=vocab - 1)))).nan_to_num().sum(1)
    kd = kd + torch.where(p_o > 0, p_o * (log_p_o - log_q_o), 0.0)
    w = torch.where(sample_ok, ht_weights(targets.sample_logprobs.double(), targets.log_threshold.double(), scheme),
                    0.0)
    log_q_s = log_q.gather(1, sample_ids.clamp(max=vocab - 1))
    within = (targets.sample_logprobs.double() - log_p_o[:, None]) - (log_q_s - log_q_o[:, None])
    kd = kd + torch.where(w > 0, w * within, 0.0).sum(1)
    counted = torch.ones(rows, dtype=torch.bool) if mask is None else mask
    kd_mean = torch.where(counted, kd, 0.0).sum() / max(int(counted.sum()), 1)
    if labels is None:
        return kd_mean
    labels = torch.where(counted, labels, -100)
    ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / max(int((labels != -100).sum()), 1)
    return kd_weight * kd_mean + (1 - kd_weight) * ce


def make_case(rows: int, vocab: int, width: int, plan: SamplingPlan, teacher_vocab: int | None = None,
              seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(rows, teacher_vocab or vocab, generator=gen) * 2
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::4] = -100
    return {
        "hidden": torch.randn(rows, width, generator=gen, dtype=torch.float64, requires_grad=True),
        "weight": (torch.randn(vocab, width, generator=gen, dtype=torch.float64) / width**0.5).requires_grad_(),
        "bias": (torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.1).requires_grad_(),
        "targets": draw(teacher, plan), "mask": torch.rand(rows, generator=gen) > 0.3, "labels": labels,
    }


def loss_and_grads(fn, case: dict, **kwargs) -> tuple[Tensor, list[Tensor]]:  # noqa: ANN001
    params = [case["hidden"], case["weight"], case["bias"]]
    for p in params:
        p.grad = None
    loss = fn(case["hidden"], case["weight"], case["bias"], case["targets"], **kwargs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def fused(hidden, weight, bias, targets, scheme, chunk_tokens=4096, **kwargs):  # noqa: ANN001, ANN201
    return fused_sampled_kl(hidden, weight, targets, scheme=scheme, bias=bias, chunk_tokens=chunk_tokens, **kwargs)


def assert_matches_reference(case: dict, scheme: str, chunk_tokens: int, **kwargs) -> None:  # noqa: ANN003
    loss, grads = loss_and_grads(fused, case, scheme=scheme, chunk_tokens=chunk_tokens, **kwargs)
    ref_loss, ref_grads = loss_and_grads(dense_reference, case, scheme=scheme, **kwargs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("rows", "vocab", "width", "head", "samples", "chunk_tokens"),
                         [(1, 50, 8, 16, 24, 1), (7, 37, 5, 0, 11, 3), (23, 61, 12, 9, 7, 8), (13, 31, 4, 1, 30, 5)])
# noqa: ANN001
def test_fused_loss_matches_the_dense_reference(scheme, rows, vocab, width, head, samples, chunk_tokens) -> None:
    case = make_case(rows, vocab, width, SamplingPlan(head=head, samples=samples, scheme=scheme, seed=rows), seed=vocab)
    assert target_kind(case["targets"]) == ("hybrid" if head else "sampled")
    assert_matches_reference(case, scheme, chunk_tokens)
    assert_matches_reference(case, scheme, chunk_tokens, mask=case["mask"])
    assert_matches_reference(case, scheme, chunk_tokens, mask=case["mask"], labels=case["labels"], kd_weight=0.7)


def test_teacher_ids_beyond_the_student_vocabulary_match_the_reference() -> None:
    case = make_case(19, 30, 6, SamplingPlan(head=8, samples=10, seed=2), teacher_vocab=34, seed=3)
    assert bool((case["targets"].head_ids >= 30).any()) and bool((case["targets"].sample_ids >= 30).any())
    with pytest.warns(UserWarning, match="student's vocabulary"):
        assert_matches_reference(case, "priority", 4)


def test_all_positions_masked_gives_zero_loss_and_zero_grads() -> None:
    case = make_case(5, 20, 4, SamplingPlan(head=3, samples=4))
    loss, grads = loss_and_grads(fused, case, scheme="priority", mask=torch.zeros(5, dtype=torch.bool))
    assert loss.item() == 0.0 and all(not g.any() for g in grads)


def test_global_counts_split_a_batch_into_parts_that_sum_to_it() -> None:
    case = make_case(21, 30, 6, SamplingPlan(head=5, samples=7, seed=4, scheme="gumbel"))
    kwargs = {"scheme": "gumbel", "chunk_tokens": 4, "labels": case["labels"], "kd_weight": 0.5}
    whole, whole_grads = loss_and_grads(fused, case, **kwargs)
    counts = (21, int((case["labels"] != -100).sum()))
    total, weight_grad = 0.0, torch.zeros_like(whole_grads[1])
    for part in (slice(0, 8), slice(8, 21)):
        hidden = case["hidden"].detach()[part].clone().requires_grad_()
        weight = case["weight"].detach().clone().requires_grad_()
        loss = fused_sampled_kl(hidden, weight, case["targets"].map(lambda t, p=part: t[p]), bias=case["bias"].detach(),
                                global_counts=counts, **(kwargs | {"labels": case["labels"][part]}))
        loss.backward()
        total, weight_grad = total + loss.detach(), weight_grad + weight.grad
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight_grad, whole_grads[1], rtol=1e-10, atol=1e-12)


def test_float32_and_bfloat16_autocast_stay_close_to_float64() -> None:
    case = make_case(40, 64, 16, SamplingPlan(head=4, samples=8, seed=1), seed=7)
    hidden, weight = case["hidden"].detach().float(), case["weight"].detach().float()
    exact = float(dense_reference(hidden, weight, None, case["targets"], "priority"))
    single = float(fused_sampled_kl(hidden, weight, case["targets"], scheme="priority", chunk_tokens=16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = float(fused_sampled_kl(hidden, weight, case["targets"], scheme="priority", chunk_tokens=16))
    assert abs(single - exact) < 1e-5 and abs(low - exact) < 0.05 * abs(exact) + 1e-3


def test_bad_options_raise() -> None:
    case = make_case(4, 20, 4, SamplingPlan(head=3, samples=4))
    with pytest.raises(ValueError, match="temperature must be 1 with sampled targets"):
        fused(case["hidden"], case["weight"], None, case["targets"], "priority", temperature=2.0)
    with pytest.raises(ValueError, match="scheme must be one of"):
        fused(case["hidden"], case["weight"], None, case["targets"], "uniform")
    with pytest.raises(ValueError, match="labels are required"):
        fused(case["hidden"], case["weight"], None, case["targets"], "priority", kd_weight=0.5)
