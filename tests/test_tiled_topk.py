"""The tiled top-K (kdflow.tasks.teacher.tiled_topk) against a dense reference, and its Triton tile kernel run
through Triton's interpreter against the torch tile statistics, on fresh random inputs each run."""

from __future__ import annotations

import os

import pytest
import torch

from kdflow.tasks.teacher.tile_stats_kernel import tile_stats_triton, triton_available
from kdflow.tasks.teacher.tiled_topk import tile_stats_torch, tiled_topk

pytestmark = pytest.mark.unit


def dense(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every id at once, float64: the top k, the log-sum-exp, and the log-sum-exp of what is left."""
    wide = logits.double()
    values, ids = wide.topk(k, dim=1)
    rest = wide.scatter(1, ids, float("-inf"))
    return values, ids, wide.logsumexp(1), rest.logsumexp(1)


def logits_of(rows: int, vocab: int, generator: torch.Generator, peak: float = 0.0) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[:, 0] += peak  # a peaked row: almost all mass on one id, a tail of ~exp(-peak)
    return logits


@pytest.mark.parametrize("vocab, k, tile", [(1000, 16, 32), (4096, 128, 128), (333, 7, 64), (50, 50, 8),
                                            (129, 1, 128)])
def test_tiled_topk_equals_every_id_at_once(vocab: int, k: int, tile: int) -> None:
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    logits = logits_of(9, vocab, generator)
    top, ids, lse, rest = tiled_topk(logits, k, tile)
    want_top, want_ids, want_lse, want_rest = dense(logits, k)
    torch.testing.assert_close(top.double(), want_top, rtol=0, atol=0)
    assert torch.equal(ids.sort(1).values, want_ids.sort(1).values)  # random floats: no ties
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-6)
    if k < vocab:
        torch.testing.assert_close(rest.double(), want_rest, rtol=0, atol=2e-6)
    else:
        assert torch.isneginf(rest).all()


@pytest.mark.parametrize("vocab", [3000, 3072])  # a last tile cut short; whole tiles (copied a tile at a time)
def test_a_peaked_rows_tail_keeps_its_relative_precision(vocab: int) -> None:
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    logits = logits_of(4, vocab, generator, peak=40.0)  # tail mass ~1e-13 of the row's
    _, _, lse, rest = tiled_topk(logits, 16, 64)
    _, _, want_lse, want_rest = dense(logits, 16)
    tail, want_tail = (rest.double() - lse.double()), want_rest - want_lse
    assert (want_tail < -20).all()
    torch.testing.assert_close(tail, want_tail, rtol=0, atol=1e-4)  # log of ~1e-13, not log(1 - ~1) = -inf


@pytest.mark.parametrize("vocab", [700, 704])
def test_bf16_logits_and_minus_infinity_entries(vocab: int) -> None:
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    logits = logits_of(5, vocab, generator)
    logits[:, 300:] = float("-inf")  # a masked part of the vocabulary: whole tiles of -inf
    low = logits.bfloat16()
    top, ids, lse, rest = tiled_topk(low, 32, 64)
    want_top, want_ids, want_lse, want_rest = dense(low.float(), 32)
    torch.testing.assert_close(top.double(), want_top, rtol=0, atol=0)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-6)
    torch.testing.assert_close(rest.double(), want_rest, rtol=0, atol=2e-6)


def test_a_block_that_is_a_view_of_wider_rows_reads_the_same() -> None:
    """Logits whose rows are not contiguous (a column slice) take the indexed gather: the same results."""
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    wide = logits_of(6, 640, generator)
    view, copy = wide[:, :512], wide[:, :512].contiguous()
    for got, want in zip(tiled_topk(view, 20, 64), tiled_topk(copy, 20, 64), strict=True):
        assert torch.equal(got, want)


def test_bad_k_and_tile_are_refused() -> None:
    with pytest.raises(ValueError, match="k must be between 1 and the vocabulary size 10"):
        tiled_topk(torch.zeros(2, 10), 11)
    with pytest.raises(ValueError, match="tile must be >= 1"):
        tiled_topk(torch.zeros(2, 10), 2, tile=0)


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("dtype, vocab, tile, group", [(torch.float32, 1000, 32, 4), (torch.bfloat16, 777, 64, 2),
                                                       (torch.float32, 128, 128, 1)])
def test_the_triton_tile_kernel_equals_the_torch_tile_statistics(monkeypatch: pytest.MonkeyPatch,
                                                                  dtype: torch.dtype, vocab: int, tile: int,
                                                                  group: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors through Triton's interpreter
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    logits = logits_of(3, vocab, generator).to(dtype)
    logits[1, : 2 * tile] = float("-inf")
    got_max, got_sum = tile_stats_triton(logits, tile, group)
    want_max, want_sum = tile_stats_torch(logits, tile)
    torch.testing.assert_close(got_max, want_max, rtol=0, atol=0)
    torch.testing.assert_close(got_sum, want_sum, rtol=1e-5, atol=1e-6)
    top, ids, lse, rest = tiled_topk(logits, 20, tile, stats=lambda x, t: tile_stats_triton(x, t, group))
    want = tiled_topk(logits, 20, tile)
    torch.testing.assert_close(top, want[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, want[2], rtol=0, atol=1e-5)


def test_the_triton_tile_kernel_refuses_cpu_tensors_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        tile_stats_triton(torch.zeros(2, 64), 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiled_head_keeps_the_slab_loops_contract(dtype: torch.dtype) -> None:
    from kdflow.tasks.teacher.tiled_topk import tiled_head_topk
    from kdflow.tasks.teacher.topk import chunked_topk

    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    hidden = torch.randn(37, 24, generator=generator).to(dtype)
    weight = torch.randn(500, 24, generator=generator).to(dtype)
    ids, logprobs, tail = tiled_head_topk(hidden, weight, 16, chunk_tokens=10, tile=32)
    want_ids, want_logprobs, want_tail = chunked_topk(hidden, weight, 16, 10, return_tail=True)
    assert ids.dtype == want_ids.dtype == torch.int32 and logprobs.shape == want_logprobs.shape == (37, 16)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(tail, want_tail, rtol=0, atol=1e-5)
    if dtype == torch.float32:  # bf16 logits tie: equal values, maybe other ids
        assert torch.equal(ids, want_ids)


@pytest.mark.parametrize("interpret", [False, True])
def test_the_head_benchmark_measures_each_variant_and_agrees_with_the_slab_loop(interpret: bool) -> None:
    """On a CPU the Triton variants are skipped, unless asked to run through Triton's interpreter (the suite sets
    TRITON_INTERPRET=1): their values, not their speed."""
    from kdflow.bench.head import TRITON_VARIANTS, build_parser, records

    args = build_parser().parse_args(["--vocab", "300", "--hidden", "16", "--tokens", "40", "--chunk-tokens", "16",
                                      "--top-k", "8", "--tile", "32", "--repeats", "1", "--gemm-tiles", "16x64x16:1:4",
                                      *(["--interpret"] if interpret else [])])
    lines = [record for record in records(args) if "variant" in record]
    found = {record["variant"]: record for record in lines}
    assert set(found) == {"matmul", "slab", "tiled", "tiled-triton", "tiled-gemm", "sampled-slab", "sampled-tiled",
                          "sampled-tiled-triton", "sampled-tiled-gemm"}
    interpreted = interpret and triton_available()
    assert all(("skipped" in found[name]) != interpreted for name in TRITON_VARIANTS)
    compared = ["tiled", "sampled-tiled"] + (list(TRITON_VARIANTS) if interpreted else [])
    for record in lines:  # each against its own slab loop
        if record["variant"] in compared:
            assert record["ids_agree"] == 1.0 and record["max_logprob_diff"] < 1e-5, record
    if interpreted:  # the device's tiling, then (top-K) the one asked for
        assert [r["gemm_tiles"] for r in lines if r["variant"] == "tiled-gemm"] == ["16x128x32:1:4", "16x64x16:1:4"]
        assert [r["gemm_tiles"] for r in lines if r["variant"] == "sampled-tiled-gemm"] == ["16x128x32:1:4"]
    assert found["sampled-tiled"]["sampling"] == {"head": 16, "samples": 12, "hash_version": "kdflow.2"}
    assert found["slab"]["us_per_token"] > 0 and found["tiled"]["over_matmul"] > 0


def test_a_bf16_teacher_with_float32_logits_takes_the_tiled_head(tiny_teacher_dir) -> None:
    """`teacher.lm_head_float32` (the default) wraps a 16-bit lm_head: the tiled head and the tiled sampler read its
    float32 logits (never rounded to 16 bits), as the slab loop does, instead of falling back to the slab loop."""
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.float32_logits import Float32Logits
    from kdflow.tasks.common.models import output_layer
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.sampled_step import TeacherSampledStep
    from kdflow.tasks.teacher.sampling import SamplingPlan
    from kdflow.tasks.teacher.topk import TeacherTopkStep

    model = load_teacher(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="bfloat16"))
    assert isinstance(output_layer(model), Float32Logits)
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    tiled, slab = TeacherTopkStep(model, 16, 8, head="tiled"), TeacherTopkStep(model, 16, 8)
    assert (tiled.head, slab.head) == ("tiled", "slab")
    got, want = tiled(ids), slab(ids)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)  # float32 logits: no bf16 ties to reorder
    assert torch.equal(got[0], want[0])
    plan = SamplingPlan(head=4, samples=6)
    sampled = [TeacherSampledStep(model, plan, 8, head=head) for head in ("tiled", "slab")]
    assert sampled[0].head == "tiled"
    drawn = [step(ids, shard=0, first_row=0) for step in sampled]
    assert torch.equal(drawn[0].sample_ids, drawn[1].sample_ids) and torch.equal(drawn[0].head_ids,
                                                                                 drawn[1].head_ids)
