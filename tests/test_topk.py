"""Chunked teacher top-K against a dense reference: full logits -> log_softmax -> topk."""

from __future__ import annotations

import pytest
import torch
from support.topk import VOCAB, dense_reference, dense_tail, random_head, random_hidden
from torch import Tensor, nn

from kdflow.tasks.common.models import LogitTransform
from kdflow.tasks.teacher.topk import choose_chunk_tokens, chunked_topk


@pytest.mark.parametrize(
    ("n_tokens", "k", "chunk_tokens"),
    [(100, 16, 7), (100, 16, 100), (100, 16, 1000), (1, 8, 4), (33, 1, 5), (64, 64, 64)],
)
def test_chunked_equals_dense_float32(n_tokens: int, k: int, chunk_tokens: int) -> None:
    head = random_head(0)
    hidden = random_hidden(n_tokens)
    topk_ids, topk_logprobs = chunked_topk(hidden, head, k, chunk_tokens)
    ref_ids, ref_logprobs = dense_reference(hidden, head.weight, head.bias, k)
    assert topk_ids.shape == (n_tokens, k) and topk_ids.dtype == torch.int32
    assert topk_logprobs.shape == (n_tokens, k) and topk_logprobs.dtype == torch.float32
    assert topk_ids.device == hidden.device and topk_logprobs.device == hidden.device
    assert torch.equal(topk_ids.long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)


def test_a_workspace_is_reused_across_calls_and_changes_no_result() -> None:
    """The chunk's logits buffer lives in the caller's workspace: the same memory for every micro-batch (on CPU,
    no new pages to fault in), grown when a call needs more, and the answers stay the dense reference's."""
    head, workspace = random_head(3), {}
    for n_tokens, chunk_tokens in [(100, 32), (100, 32), (20, 64), (300, 200)]:
        hidden = random_hidden(n_tokens, seed=n_tokens)
        before = workspace.get("logits_f32")
        topk_ids, topk_logprobs = chunked_topk(hidden, head, 8, chunk_tokens, vocab_chunk=100, workspace=workspace)
        ref_ids, ref_logprobs = dense_reference(hidden, head.weight, head.bias, 8)
        assert torch.equal(topk_ids.long(), ref_ids)
        torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)
        needed = min(chunk_tokens, n_tokens) * 100
        if before is not None and before.numel() >= needed:
            assert workspace["logits_f32"].data_ptr() == before.data_ptr()  # reused, not reallocated
        assert workspace["logits_f32"].numel() >= needed
    assert workspace["logits_f32"].numel() == 200 * 100  # grown once, by the largest call


@pytest.mark.parametrize(("vocab_chunk", "k"), [(100, 16), (10, 16), (VOCAB, 16), (128, 1), (64, VOCAB)])
def test_vocabulary_slabs_merge_to_the_dense_answer(vocab_chunk: int, k: int) -> None:
    """Slabs that do not divide V, slabs narrower than K, one slab, K = 1, K = V."""
    head = random_head(11)
    hidden = random_hidden(45)
    topk_ids, topk_logprobs = chunked_topk(hidden, head, k, 16, vocab_chunk=vocab_chunk)
    ref_ids, ref_logprobs = dense_reference(hidden, head.weight, head.bias, k)
    assert torch.equal(topk_ids.long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("vocab_chunk", "k"), [(None, 16), (None, 1), (100, 16), (10, 16), (7, 3), (128, 1)])
def test_tail_logprob_is_the_complement_log_sum_exp(vocab_chunk: int | None, k: int) -> None:
    """The tail equals the dense float64 log-sum-exp outside the top-K, on one slab and merged over slabs
    (slabs narrower than K drop candidates at every merge), and mass sums to 1 without any 1 - sum."""
    head = random_head(21)
    hidden = random_hidden(45)
    topk_ids, topk_logprobs, tail_logprob = chunked_topk(hidden, head, k, 16, vocab_chunk=vocab_chunk, return_tail=True)
    assert tail_logprob.shape == (45,) and tail_logprob.dtype == torch.float32
    full = torch.log_softmax(hidden.double() @ head.weight.double().T + head.bias.double(), dim=-1)  # (N, V)
    torch.testing.assert_close(tail_logprob.double(), dense_tail(full, topk_ids), atol=1e-5, rtol=1e-5)
    mass = topk_logprobs.double().exp().sum(-1) + tail_logprob.double().exp()
    torch.testing.assert_close(mass, torch.ones(45, dtype=torch.float64), atol=1e-5, rtol=0)


def test_tail_logprob_stays_exact_where_the_tail_is_tiny() -> None:
    """Peaked rows whose tail mass is ~1e-5..1e-12: 1 - sum(exp(float32)) there is rounding noise (or
    negative); the complement's log-sum-exp keeps its relative precision."""
    head = random_head(22)
    with torch.no_grad():
        head.weight.mul_(6.0)  # logits of std ~10
    hidden = random_hidden(40)
    topk_ids, topk_logprobs, tail_logprob = chunked_topk(hidden, head, 64, 16, vocab_chunk=100, return_tail=True)
    full = torch.log_softmax(hidden.double() @ head.weight.double().T + head.bias.double(), dim=-1)
    reference = dense_tail(full, topk_ids)
    assert reference.max() < -11  # the case: tail mass below 1e-5 on every row
    torch.testing.assert_close(tail_logprob.double(), reference, atol=1e-4, rtol=1e-5)
    naive = 1.0 - topk_logprobs.double().exp().sum(-1)  # what v1 readers derive
    assert ((naive - reference.exp()).abs() / reference.exp()).max() > 1e-2


def test_tail_is_empty_when_k_is_the_vocabulary() -> None:
    _, _, tail_logprob = chunked_topk(random_hidden(5), random_head(23), VOCAB, 4, return_tail=True)
    assert torch.isneginf(tail_logprob).all()
    _, _, merged = chunked_topk(random_hidden(5), random_head(23), VOCAB, 4, vocab_chunk=100, return_tail=True)
    assert torch.isneginf(merged).all()


def test_vocabulary_slabs_with_bf16_and_transform() -> None:
    head = random_head(12).to(torch.bfloat16)
    hidden = random_hidden(30).to(torch.bfloat16)
    transform = LogitTransform(scale=2.0, softcap=3.0)
    topk_ids, topk_logprobs, tail_logprob = chunked_topk(hidden, head, 8, 7, vocab_chunk=77, logit_transform=transform,
                                                         return_tail=True)
    with torch.no_grad():
        logits = head(hidden).double() * 2.0  # (N, V) rounded to bf16 by the matmul, as in the chunks
    full_logprobs = torch.log_softmax(torch.tanh(logits / 3.0) * 3.0, dim=-1)
    torch.testing.assert_close(tail_logprob.double(), dense_tail(full_logprobs, topk_ids), atol=1e-5, rtol=1e-5)
    # bf16 logits tie often, and tied ids may come in any order: check values, and that each id carries its value.
    torch.testing.assert_close(topk_logprobs.double(), full_logprobs.topk(8, dim=-1).values, atol=1e-5, rtol=0)
    torch.testing.assert_close(topk_logprobs.double(), full_logprobs.gather(1, topk_ids.long()), atol=1e-5, rtol=0)


def test_vocabulary_slabs_need_a_plain_weight() -> None:
    class ScaledHead(nn.Module):  # any module that is not exactly nn.Linear
        def __init__(self) -> None:
            super().__init__()
            self.inner = random_head(13)

        def forward(self, hidden: Tensor) -> Tensor:
            return self.inner(hidden) * 2.0

    with pytest.raises(ValueError, match="vocab_chunk needs a plain weight"):
        chunked_topk(random_hidden(4), ScaledHead(), 4, 8, vocab_chunk=100)
    with pytest.raises(ValueError, match="vocab_chunk must be"):
        chunked_topk(random_hidden(4), random_head(13), 4, 8, vocab_chunk=0)


def test_module_without_out_features_is_called_whole() -> None:
    head = random_head(14)
    scaled = nn.Sequential(head)  # not an nn.Linear: called as a module, vocabulary found by one probe row
    hidden = random_hidden(20)
    topk_ids, topk_logprobs = chunked_topk(hidden, scaled, 6, 7)
    ref_ids, ref_logprobs = dense_reference(hidden, head.weight, head.bias, 6)
    assert torch.equal(topk_ids.long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)


def test_plain_weight_tensor_without_bias() -> None:
    head = random_head(2, bias=False)
    hidden = random_hidden(50)
    topk_ids, topk_logprobs = chunked_topk(hidden, head.weight.detach(), 10, 16)
    ref_ids, ref_logprobs = dense_reference(hidden, head.weight, None, 10)
    assert torch.equal(topk_ids.long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)


def test_bias_is_applied() -> None:
    """A biased head must not give the answer of the same head without its bias."""
    head = random_head(3)
    hidden = random_hidden(20)
    _, with_bias = chunked_topk(hidden, head, 5, 8)
    _, without_bias = chunked_topk(hidden, head.weight.detach(), 5, 8)
    assert (with_bias - without_bias).abs().max() > 0.1


def test_k_equal_vocab_is_the_whole_distribution() -> None:
    head = random_head(4)
    hidden = random_hidden(9)
    topk_ids, topk_logprobs = chunked_topk(hidden, head, VOCAB, 4)
    total_mass = topk_logprobs.double().exp().sum(-1)
    torch.testing.assert_close(total_mass, torch.ones(9, dtype=torch.float64), atol=1e-6, rtol=0)  # float32 lse
    # every id exactly once per row
    assert torch.equal(topk_ids.sort(dim=-1).values, torch.arange(VOCAB, dtype=torch.int32).expand(9, VOCAB))


def test_sorted_descending_and_tail_mass_in_unit_interval() -> None:
    head = random_head(5)
    _, topk_logprobs = chunked_topk(random_hidden(40), head, 32, 6)
    assert (topk_logprobs[:, :-1] >= topk_logprobs[:, 1:]).all()
    assert (topk_logprobs <= 0).all()
    tail_mass = 1.0 - topk_logprobs.double().exp().sum(-1)
    assert ((tail_mass >= 0) & (tail_mass <= 1)).all()
    assert (tail_mass > 1e-3).all()  # K < V really leaves mass outside the top-K


def test_bfloat16_agrees_with_float32_reference_within_bf16_precision() -> None:
    head = random_head(6).to(torch.bfloat16)
    hidden = random_hidden(70).to(torch.bfloat16)
    topk_ids, topk_logprobs = chunked_topk(hidden, head, 20, 16)
    assert topk_logprobs.dtype == torch.float32
    ref_ids, ref_logprobs = dense_reference(hidden, head.weight, head.bias, 20)
    full_ref = torch.log_softmax(hidden.double() @ head.weight.double().T + head.bias.double(), dim=-1)
    # bf16 rounding of logits may swap near-equal neighbours: compare values, not positions of ids.
    bf16_tolerance = dict(atol=0.05, rtol=1.6e-2)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, **bf16_tolerance)
    torch.testing.assert_close(topk_logprobs.double(), full_ref.gather(1, topk_ids.long()), **bf16_tolerance)
    # The top-K sets (not their order) mostly coincide; only near-ties at the K-th place may differ.
    overlap = [len(set(row.tolist()) & set(ref_row.tolist())) / 20 for row, ref_row in zip(topk_ids, ref_ids)]
    assert sum(overlap) / len(overlap) > 0.97


def test_empty_input_gives_empty_outputs() -> None:
    topk_ids, topk_logprobs = chunked_topk(random_hidden(0), random_head(7), 4, 8)
    assert topk_ids.shape == (0, 4) and topk_logprobs.shape == (0, 4)


@pytest.mark.parametrize(
    ("k", "chunk_tokens", "message"),
    [(0, 8, "k must be"), (VOCAB + 1, 8, "k must be"), (4, 0, "chunk_tokens must be")],
)
def test_bad_arguments_are_named(k: int, chunk_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunked_topk(random_hidden(3), random_head(8), k, chunk_tokens)


def test_dtype_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="dtype"):
        chunked_topk(random_hidden(3), random_head(8).to(torch.bfloat16), 4, 8)


def test_logit_transform_scale_then_softcap() -> None:
    head = random_head(9)
    hidden = random_hidden(30)
    transform = LogitTransform(scale=0.5, softcap=1.5)
    topk_ids, topk_logprobs = chunked_topk(hidden, head, 12, 7, logit_transform=transform)
    logits = (hidden.double() @ head.weight.double().T + head.bias.double()) * 0.5
    capped = torch.tanh(logits / 1.5) * 1.5
    ref = torch.log_softmax(capped, dim=-1).topk(12, dim=-1)
    assert torch.equal(topk_ids.long(), ref.indices)
    torch.testing.assert_close(topk_logprobs.double(), ref.values, atol=1e-5, rtol=0)


def test_choose_chunk_tokens_fits_budget_and_rounds() -> None:
    vocab = 196_608
    rows = choose_chunk_tokens(vocab, 1 << 30)
    assert rows % 64 == 0 and rows >= 64
    assert rows * vocab * 4 * 2 <= 1 << 30 < (rows + 64) * vocab * 4 * 2
    assert choose_chunk_tokens(vocab, 1) == 64  # never below the minimum
    assert choose_chunk_tokens(vocab, 4 << 30) > rows
    with pytest.raises(ValueError, match="budget_bytes"):
        choose_chunk_tokens(vocab, 0)


# ---- the benchmark runs end to end (numbers are its output, not asserted here) --------------------------


@pytest.mark.usefixtures("children")  # measures in fresh processes
def test_bench_precompute_prints_one_json_line_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kdflow.bench.precompute import main

    argv = ["--device=cpu", "--vocab=1024", "--hidden=32", "--seq-len=4", "--micro-batches=1,3", "--top-k=8"]
    assert main([*argv, "--repeats=1", "--chunk-tokens=5", "--dense-limit-gib=0.00006"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = [(record["micro_batch"], record["mode"]) for record in records]
    assert runs == [(1, "chunked"), (1, "dense"), (3, "chunked"), (3, "dense")]
    assert all(r["status"] == "ok" for r in records[:3])
    assert records[3]["status"].startswith("skipped: would need")  # 12 tokens x 1024 x 8 bytes > the limit
    assert records[0]["ids_agreement"] == 1.0 and records[0]["max_abs_logprob_diff"] < 1e-5
    assert records[0]["peak_memory_gib"] >= 0 and records[0]["tokens_per_s"] > 0
