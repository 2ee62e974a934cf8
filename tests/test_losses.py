"""fused_topk_kl against a dense reference written here: full logits, log_softmax, gather, autograd."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from kdflow.tasks.student.losses import fused_topk_kl


def dense_reference(
    hidden: Tensor, weight: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, *,
    bias: Tensor | None = None, mask: Tensor | None = None, labels: Tensor | None = None,
    kd_weight: float = 1.0, temperature: float = 1.0,
    counts: tuple[float, float] | None = None, tail_logprob: Tensor | None = None,
) -> Tensor:
    """The K+1 bucket KL with every (N, V) tensor materialised, in float64. The tail bucket's teacher mass is
    exp(tail_logprob) plus the mass of ids beyond the student's vocabulary when given, else 1 - sum; padding
    (id < 0, log-prob -inf) is no entry at all."""
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
        buckets = torch.cat([teacher_top.log(), teacher_tail.log()[:, None]], 1) / temperature
        buckets = buckets.softmax(1)
        teacher_top, teacher_tail = buckets[:, :-1], buckets[:, -1]

    log_q = torch.log_softmax(logits / temperature, dim=1)  # (N, V)
    log_q_top = log_q.gather(1, gather_ids)
    tail_log_q = log_q.masked_fill(in_top_k, float("-inf"))
    tail_log_q = tail_log_q.masked_fill(tail_empty[:, None], 0.0)  # unused rows, keeps grads finite
    log_q_tail = tail_log_q.logsumexp(1)
    kd = (torch.xlogy(teacher_top, teacher_top) - teacher_top * log_q_top).sum(1)
    kd = kd + torch.xlogy(teacher_tail, teacher_tail) - teacher_tail * log_q_tail
    kd = kd * temperature**2

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
        "hidden": torch.randn(rows, width, generator=gen, requires_grad=True),
        "weight": (torch.randn(vocab, width, generator=gen) / width**0.5).requires_grad_(),
        "bias": (torch.randn(vocab, generator=gen) * 0.1).requires_grad_(),
        "topk_ids": ids.to(torch.int32),
        "topk_logprobs": logprobs,
        "tail_logprob": tail_logprob,
        "labels": torch.randint(0, vocab, (rows,), generator=gen),
        "mask": torch.rand(rows, generator=gen) > 0.3,
    }


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
    loss, grads = loss_and_grads(fused_topk_kl, case, **fused_kwargs)
    reference_kwargs = {key: value for key, value in kwargs.items() if key != "chunk_tokens"}
    ref_loss, ref_grads = loss_and_grads(dense_reference, case, **reference_kwargs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=atol)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m, n=name: f"grad {n}: {m}")
    return loss


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


def test_bfloat16_inputs_give_bfloat16_grads() -> None:
    case = make_case(7, 50, 8, 4, seed=11)
    hidden = case["hidden"].detach().bfloat16().requires_grad_()
    weight = case["weight"].detach().bfloat16().requires_grad_()
    fused_topk_kl(hidden, weight, case["topk_ids"], case["topk_logprobs"]).backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def test_nothing_of_size_tokens_times_vocabulary_is_saved_for_backward() -> None:
    case = make_case(130, 97, 12, 8, seed=12)
    saved: list[int] = []

    def pack(tensor: Tensor) -> Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"],
                             bias=case["bias"], chunk_tokens=32)
    loss.backward()
    assert saved and max(saved) < 130 * 97


GOLDEN_LOSS = 2.159402370452881  # this implementation in float32; the float64 reference gives 2.15940244


def test_golden_value() -> None:
    case = make_case(5, 11, 4, 3, seed=1234)
    loss = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"],
                         bias=case["bias"], labels=case["labels"], kd_weight=0.5, chunk_tokens=2)
    assert loss.item() == pytest.approx(GOLDEN_LOSS, rel=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden": torch.zeros(7)}, "hidden"),
        ({"weight": torch.zeros(50, 9)}, "weight"),
        ({"topk_ids": torch.zeros(6, 4, dtype=torch.long)}, "topk_ids"),
        ({"topk_ids": torch.zeros(7, 4)}, "topk_ids"),
        ({"topk_logprobs": torch.zeros(7, 5)}, "topk_logprobs"),
        ({"bias": torch.zeros(49)}, "bias"),
        ({"mask": torch.ones(7)}, "mask"),
        ({"labels": torch.zeros(7)}, "labels"),
        ({"labels": torch.full((7,), 50)}, "labels"),
        ({"topk_ids": torch.full((7, 4), -1)}, "negative"),
        ({"kd_weight": 1.5}, "kd_weight"),
        ({"kd_weight": 0.5, "labels": None}, "labels are required"),
        ({"temperature": 0.0}, "temperature"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
    ],
)
def test_bad_input_is_a_one_line_value_error(change: dict, message: str) -> None:
    case = make_case(7, 50, 8, 4)
    kwargs = {"hidden": case["hidden"], "weight": case["weight"], "topk_ids": case["topk_ids"],
              "topk_logprobs": case["topk_logprobs"], "bias": case["bias"]} | change
    with pytest.raises(ValueError, match=message) as error:
        fused_topk_kl(**kwargs)
    assert "\n" not in str(error.value)


def test_negative_ids_in_masked_positions_are_ignored() -> None:
    case = make_case(7, 50, 8, 4)
    mask = torch.ones(7, dtype=torch.bool)
    mask[3] = False
    padded_ids = case["topk_ids"].clone()
    padded_ids[3] = -1  # padding in a position that does not count
    args = (case["hidden"], case["weight"])
    loss = fused_topk_kl(*args, padded_ids, case["topk_logprobs"], mask=mask)
    torch.testing.assert_close(loss, fused_topk_kl(*args, case["topk_ids"], case["topk_logprobs"], mask=mask))


# ---- v2 stores: the tail stored exactly, padding of adaptive K -------------------------------------------


@pytest.mark.parametrize(("rows", "vocab", "top_k", "chunk_tokens", "teacher_vocab"),
                         [(37, 64, 8, 16, None), (130, 97, 20, 64, None), (37, 64, 8, 10, 80), (1, 50, 4, 1, None)])
def test_explicit_tail_matches_reference(rows, vocab, top_k, chunk_tokens, teacher_vocab) -> None:
    case = make_case(rows, vocab, 12, top_k, seed=20, teacher_vocab=teacher_vocab)
    labels = case["labels"].clone()
    labels[::3] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ids beyond the student's vocabulary (teacher_vocab=80) warn
        assert_matches_reference(case, chunk_tokens=chunk_tokens, tail_logprob=case["tail_logprob"])
        assert_matches_reference(case, chunk_tokens=chunk_tokens, tail_logprob=case["tail_logprob"], labels=labels,
                                 kd_weight=0.4, mask=case["mask"])
        assert_matches_reference(case, chunk_tokens=chunk_tokens, tail_logprob=case["tail_logprob"], temperature=2.0)


def test_explicit_tail_is_used_not_one_minus_sum() -> None:
    """Quantised log-probs (as a v2 store decodes them) no longer sum to 1 - tail: the loss must take the stored
    tail. A tail that differs from 1 - sum changes the loss (and matches the reference that uses it)."""
    case = make_case(37, 64, 16, 8, seed=21, sharpness=1.0)
    case["topk_logprobs"] = 2 * torch.log(torch.round(400 * (case["topk_logprobs"] / 2).exp()) / 400)  # sqrt/400
    with_tail = assert_matches_reference(case, chunk_tokens=8, tail_logprob=case["tail_logprob"])
    derived = assert_matches_reference(case, chunk_tokens=8)
    assert (with_tail - derived).abs() > 1e-6  # ~1.2e-5 here: the quantised values' sum moved 1 - sum
    one_minus_sum = (1 - case["topk_logprobs"].double().exp().sum(1)).log().float()
    loss = fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"], bias=case["bias"],
                         tail_logprob=one_minus_sum, chunk_tokens=8)
    torch.testing.assert_close(loss.double(), derived, rtol=1e-5, atol=1e-6)


def test_empty_tail_and_tiny_tail() -> None:
    case = make_case(37, 64, 16, 8, seed=22, sharpness=40.0)  # nearly one-hot: tails ~1e-30
    assert case["tail_logprob"].max() < -20
    assert_matches_reference(case, chunk_tokens=16, tail_logprob=case["tail_logprob"])
    case["tail_logprob"] = torch.full_like(case["tail_logprob"], float("-inf"))  # no tail mass at all
    assert_matches_reference(case, chunk_tokens=16, tail_logprob=case["tail_logprob"])


def test_padding_of_adaptive_k_is_no_entry() -> None:
    """Adaptive-K rows keep their first `kept` ids; the rest is padding (id -1, log-prob -inf) and the dropped
    mass is in the stored tail. Same as the reference, and the same as the shorter rows without padding."""
    case = make_case(37, 64, 16, 8, seed=23)
    kept = torch.randint(1, 9, (37,), generator=torch.Generator().manual_seed(1))
    pad = torch.arange(8)[None, :] >= kept[:, None]
    dropped = torch.where(pad, case["topk_logprobs"].double().exp(), 0.0).sum(1)
    tail = (case["tail_logprob"].double().exp() + dropped).log().float()
    padded = dict(case, topk_ids=case["topk_ids"].masked_fill(pad, -1),
                  topk_logprobs=case["topk_logprobs"].masked_fill(pad, float("-inf")), tail_logprob=tail)
    loss = assert_matches_reference(padded, chunk_tokens=16, tail_logprob=tail, labels=case["labels"], kd_weight=0.5)
    one_row = [fused_topk_kl(case["hidden"][r:r + 1], case["weight"], case["topk_ids"][r:r + 1, :kept[r]],
                             case["topk_logprobs"][r:r + 1, :kept[r]], bias=case["bias"], tail_logprob=tail[r:r + 1])
               for r in range(37)]
    kd_only = fused_topk_kl(padded["hidden"], padded["weight"], padded["topk_ids"], padded["topk_logprobs"],
                            bias=case["bias"], tail_logprob=tail)
    torch.testing.assert_close(kd_only, torch.stack(one_row).mean(), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(loss)


def test_negative_ids_with_a_finite_logprob_are_refused() -> None:
    case = make_case(7, 50, 8, 4)
    ids = case["topk_ids"].clone()
    ids[2, 3] = -1  # log-prob stays finite: not padding
    with pytest.raises(ValueError, match="1 negative ids"):
        fused_topk_kl(case["hidden"], case["weight"], ids, case["topk_logprobs"], tail_logprob=case["tail_logprob"])
    with pytest.raises(ValueError, match="tail_logprob must be"):
        fused_topk_kl(case["hidden"], case["weight"], case["topk_ids"], case["topk_logprobs"],
                      tail_logprob=case["tail_logprob"][:3])
