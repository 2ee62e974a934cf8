"""fused_topk_kl, continued from test_losses.py: memory saved for backward, a golden value, one-line errors for
bad input, and v2 stores (the tail stored exactly, padding of adaptive K)."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.losses import assert_matches_reference, make_case
from torch import Tensor

from kdflow.tasks.student.losses import fused_topk_kl


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
        ({"temperature": 2.0}, "temperature=2.0 needs tail_tempered"),
        ({"temperature": 2.0, "tail_tempered": torch.zeros(6)}, "tail_tempered"),
        ({"temperature": 2.0, "tail_tempered": torch.zeros(7, dtype=torch.long)}, "tail_tempered"),
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
