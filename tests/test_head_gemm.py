"""The tiled-gemm head (kdflow.tasks.teacher.head_gemm): its Triton GEMM run through Triton's interpreter (the suite
sets TRITON_INTERPRET=1, CPU tensors) against a float64 matmul and the tile statistics (and the sampler's keys) of
what it wrote, and the head's targets against the tiled head's and the slab loop's, on fresh random inputs each
run."""

from __future__ import annotations

import os

import pytest
import torch

from kdflow.tasks.teacher.tile_stats_kernel import triton_available
from kdflow.tasks.teacher.tiled_topk import tile_stats_torch, tiled_head_topk

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not triton_available(), reason="Triton is not installed")]


def fresh() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.parametrize("weights, logits", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("width, tiling", [(64, None), (40, None), (64, "16x128x32:1:4")])
def test_the_gemm_writes_the_logits_and_the_statistics_of_what_it_wrote(weights: torch.dtype, logits: torch.dtype,
                                                                       width: int, tiling: str | None) -> None:
    """A last K step cut short (masked); two head tiles in one program's block of ids."""
    from kdflow.tasks.teacher.gemm_tiles import GemmTiles
    from kdflow.tasks.teacher.head_gemm import head_gemm_stats

    generator = fresh()
    rows = int(torch.randint(1, 40, (1,), generator=generator))
    vocab = int(torch.randint(300, 700, (1,), generator=generator))  # a last tile cut short (padding)
    hidden = torch.randn(rows, width, generator=generator).to(weights)
    weight = (torch.randn(vocab, width, generator=generator) / width**0.5).to(weights)
    out = torch.full((rows, vocab), float("nan"), dtype=logits)
    tile_max, tile_sum = head_gemm_stats(hidden, weight, out, tile=64, tiling=tiling and GemmTiles.parse(tiling))
    exact = hidden.double() @ weight.double().t()
    if logits == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    else:  # one bf16 step at most (the interpreter truncates to 16 bits where a GPU rounds to nearest)
        assert bool(((out.double() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-6).all())
    want_max, want_sum = tile_stats_torch(out, 64)
    assert tile_max.shape == (rows, -(-vocab // 64))
    torch.testing.assert_close(tile_max, want_max, rtol=0, atol=0)  # the max of what was written, exactly
    torch.testing.assert_close(tile_sum, want_sum, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype, float32", [(torch.float32, False), (torch.bfloat16, True)])
def test_the_tiled_gemm_head_gives_the_tiled_heads_and_the_slab_loops_targets(dtype: torch.dtype,
                                                                              float32: bool) -> None:
    from kdflow.tasks.teacher.topk import chunked_topk

    generator = fresh()
    hidden = torch.randn(37, 32, generator=generator).to(dtype)
    weight = torch.randn(500, 32, generator=generator).to(dtype)
    got = tiled_head_topk(hidden, weight, 16, chunk_tokens=10, tile=32, float32=float32, variant="tiled-gemm")
    tiled = tiled_head_topk(hidden, weight, 16, chunk_tokens=10, tile=32, float32=float32)
    head: torch.Tensor | torch.nn.Module = weight
    if float32:
        from kdflow.tasks.common.float32_logits import Float32Logits

        linear = torch.nn.Linear(32, 500, bias=False, dtype=dtype)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        head = Float32Logits(linear)
    slab = chunked_topk(hidden, head, 16, 10, return_tail=True)
    for want in (tiled, slab):
        assert torch.equal(got[0], want[0])  # float32 logits: no 16-bit ties to order otherwise
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("scheme", ["priority", "gumbel"])
@pytest.mark.parametrize("weights, logits", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_for_sampled_targets_the_gemm_also_writes_each_tiles_max_key(scheme: str, weights: torch.dtype,
                                                                     logits: torch.dtype) -> None:
    from kdflow.tasks.teacher.gemm_tiles import GemmTiles
    from kdflow.tasks.teacher.head_gemm import head_gemm_sample_stats
    from kdflow.tasks.teacher.sample_tile_kernel import sample_tile_stats_triton
    from kdflow.tasks.teacher.sampled_tiles import sample_tile_stats_torch
    from kdflow.tasks.teacher.sampling_noise import position_streams, stream_words

    generator = fresh()
    rows, vocab = 19, int(torch.randint(300, 700, (1,), generator=generator))
    hidden = torch.randn(rows, 32, generator=generator).to(weights)
    weight = torch.randn(vocab, 32, generator=generator).to(weights)
    words = stream_words(position_streams(int(torch.randint(0, 99, (1,), generator=generator)), 3,
                                          torch.arange(rows) // 5, torch.arange(rows) % 5))
    out = torch.empty((rows, vocab), dtype=logits)
    got = head_gemm_sample_stats(hidden, weight, out, words, scheme, tile=64,
                                 tiling=GemmTiles.parse("16x128x32:1:4"))  # two head tiles a program
    kernel = sample_tile_stats_triton(out, words, scheme, 64)  # the sampler's own kernel on what the GEMM wrote
    assert torch.equal(got[0], kernel[0]) and torch.equal(got[2], kernel[2])  # one arithmetic: the same bits
    torch.testing.assert_close(got[1], kernel[1], rtol=1e-5, atol=0)
    want = sample_tile_stats_torch(out, words, scheme, 64)
    torch.testing.assert_close(got[2], want[2], rtol=2e-6, atol=2e-6)  # and torch's form of the keys


def test_the_pass_steps_read_a_teachers_head_through_the_gemm(tiny_teacher_dir) -> None:
    """A whole teacher's steps with `precompute.head: tiled-gemm`: on a CPU they run as tiled (the GEMM is a CUDA
    kernel), and made to run the GEMM (through the interpreter) they give the same targets. Fixed inputs: the
    GEMM's sums run in another order than torch's matmul, which may swap two sampled keys that close."""
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.sampled_step import TeacherSampledStep
    from kdflow.tasks.teacher.sampling import SamplingPlan
    from kdflow.tasks.teacher.topk import TeacherTopkStep

    model = load_teacher(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="bfloat16"))
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(3))
    step = TeacherTopkStep(model, 16, 8, head="tiled-gemm")
    assert step.head == "tiled"
    want = step(ids)
    step.head = "tiled-gemm"  # what it runs on CUDA
    got = step(ids)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5)
    sampler = TeacherSampledStep(model, SamplingPlan(head=4, samples=6), 8, head="tiled-gemm")
    assert sampler.head == "tiled"
    expected = sampler(ids, shard=1, first_row=0)
    sampler.head = "tiled-gemm"
    drawn = sampler(ids, shard=1, first_row=0)
    assert torch.equal(drawn.head_ids, expected.head_ids) and torch.equal(drawn.sample_ids, expected.sample_ids)
    torch.testing.assert_close(drawn.sample_logprobs, expected.sample_logprobs, rtol=0, atol=1e-5)


def test_bad_input_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdflow.tasks.teacher.gemm_tiles import GemmTiles
    from kdflow.tasks.teacher.head_gemm import head_gemm_sample_stats, head_gemm_stats
    from kdflow.tasks.teacher.tiled_topk import tiled_blocks

    hidden, weight, out = torch.zeros(4, 32), torch.zeros(100, 32), torch.zeros(4, 100)
    with pytest.raises(ValueError, match="tile must be a power of two >= 16, got 48"):
        head_gemm_stats(hidden, weight, out, tile=48)
    with pytest.raises(ValueError, match="one dtype"):
        head_gemm_stats(hidden.bfloat16(), weight, out)
    with pytest.raises(ValueError, match=r"out must be \(4, 100\) of float32"):
        head_gemm_stats(hidden, weight, torch.zeros(4, 99))
    with pytest.raises(ValueError, match="unknown tiled head variant 'gemm'"):
        next(tiled_blocks(hidden, weight, 4, variant="gemm"))
    with pytest.raises(ValueError, match=r"GEMM tiles '128x128': write BMxBNxBK:STAGES:WARPS"):
        GemmTiles.parse("128x128")
    with pytest.raises(ValueError, match="powers of two"):
        GemmTiles.parse("128x96x64:3:8")
    with pytest.raises(ValueError, match="64 ids a program is not a whole number of tiles of 128"):
        head_gemm_stats(hidden, weight, out, tiling=GemmTiles.parse("16x64x32:1:4"))
    with pytest.raises(ValueError, match=r"words must have one entry per row \(4\)"):
        head_gemm_sample_stats(hidden, weight, out, torch.zeros(3, dtype=torch.int32), "gumbel")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="the tiled-gemm head runs on CUDA tensors .*: set precompute.head to tiled"):
        head_gemm_stats(hidden, weight, out)
