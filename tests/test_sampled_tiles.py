"""The tiled sampler (kdflow/tasks/teacher/sampled_tiles.py) against the slab loop's sampler, the dense reference of
test_sampling.py standing behind that; its Triton kernels through Triton's interpreter against their torch forms on
fresh random inputs; the teacher step taking it with `precompute.head: tiled`."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch
from torch import Tensor

from kdflow.schemas.sampled_settings import SCHEMES
from kdflow.tasks.common.sampled import SampledTargets
from kdflow.tasks.teacher.sampled_step import TeacherSampledStep, tiled_head_sample
from kdflow.tasks.teacher.sampled_tiles import sample_tile_stats_torch, tile_keys_torch, tiled_sample
from kdflow.tasks.teacher.sampling import SamplingPlan, chunked_sampled, sample_slabs
from kdflow.tasks.teacher.sampling_noise import position_streams, stream_words

pytestmark = pytest.mark.unit
FIELDS = [f.name for f in fields(SampledTargets)]


def streams_of(rows: int, seed: int = 0) -> Tensor:
    return position_streams(seed, 3, torch.arange(rows) // 5, torch.arange(rows) % 5)


def slab_loop(logits: Tensor, plan: SamplingPlan, streams: Tensor) -> SampledTargets:
    return sample_slabs([(0, logits.float())], plan, streams, logits.shape[1])


def assert_same_targets(a: SampledTargets, b: SampledTargets, context: object) -> None:
    """The same ids in the same order; values within the log-sum-exps' rounding (sums taken in another order)."""
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if name.endswith("_ids"):
            assert torch.equal(x, y), (name, context)
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n} {context}: {m}")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("head", "samples", "vocab", "tile"),
                         [(16, 8, 1000, 32), (0, 12, 999, 16), (5, 45, 300, 128), (49, 1, 50, 8), (3, 47, 50, 4),
                          (4, 6, 257, 1)])
def test_the_tiled_sampler_draws_what_the_slab_loop_draws(scheme: str, head: int, samples: int, vocab: int,
                                                          tile: int) -> None:
    seed = random.randrange(1 << 30)  # fresh inputs each run; the seed is in the message
    logits = torch.randn(13, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    plan = SamplingPlan(head=head, samples=samples, scheme=scheme, seed=seed % 7)
    streams = streams_of(13, seed)
    assert_same_targets(tiled_sample(logits, plan, streams, tile), slab_loop(logits, plan, streams), seed)


@pytest.mark.parametrize("tile", [1, 4, 8, 16, 64])
def test_ties_and_impossible_ids_go_as_in_the_slab_loop(tile: int) -> None:
    logits = torch.randint(-3, 3, (9, 40), generator=torch.Generator().manual_seed(2)).float()
    logits[4] = 0.0  # a row of equal logits
    logits[5, 10:] = -torch.inf  # fewer finite ids than H + S
    logits[6, :30] = -torch.inf
    for scheme in SCHEMES:
        plan = SamplingPlan(head=7, samples=20, scheme=scheme)
        streams = streams_of(9)
        assert_same_targets(tiled_sample(logits, plan, streams, tile), slab_loop(logits, plan, streams), tile)


def test_bf16_logits_are_read_as_they_are() -> None:
    logits = (torch.randn(6, 700, generator=torch.Generator().manual_seed(4)) * 4).bfloat16()
    plan = SamplingPlan(head=8, samples=8)
    streams = streams_of(6)
    assert_same_targets(tiled_sample(logits, plan, streams, 64), slab_loop(logits, plan, streams), "bf16")


def test_bad_input_is_refused_in_one_line() -> None:
    logits = torch.randn(3, 50)
    with pytest.raises(ValueError, match=r"^the tiled sampler draws kdflow.2 noise, not kdflow.1"):
        tiled_sample(logits, SamplingPlan(head=2, samples=3, hash_version="kdflow.1"), streams_of(3))
    logits[1, 7] = torch.nan
    with pytest.raises(ValueError, match="NaN"):
        tiled_sample(logits, SamplingPlan(head=2, samples=3), streams_of(3), 16)


def test_the_teacher_step_takes_the_tiled_sampler_where_it_fits(tiny_teacher_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    plan = SamplingPlan(head=4, samples=6, scheme="gumbel", seed=9)
    input_ids = torch.randint(0, 384, (3, 16), generator=torch.Generator().manual_seed(0))
    tiled = TeacherSampledStep(model, plan, chunk_tokens=10, head="tiled")
    slab = TeacherSampledStep(model, plan, chunk_tokens=10)
    assert (tiled.head, slab.head) == ("tiled", "slab")
    assert TeacherSampledStep(model, SamplingPlan(head=4, samples=6, hash_version="kdflow.1"), 10,
                              head="tiled").head == "slab"  # kdflow.1 has no tiled form
    assert TeacherSampledStep(model, plan, 10, head="tiled", vocab_chunk=100).head == "slab"
    assert_same_targets(tiled(input_ids, shard=5, first_row=8), slab(input_ids, shard=5, first_row=8), "step")


def test_the_tiled_head_keeps_the_chunked_samplers_contract() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(23, 8, generator=gen), torch.randn(300, 8, generator=gen)
    plan = SamplingPlan(head=5, samples=7, seed=1)
    rows, positions = torch.arange(23) // 4, torch.arange(23) % 4
    expected = chunked_sampled(hidden, weight, plan, 23, shard=2, rows=rows, positions=positions)
    for chunk in (1, 5, 23, 64):
        got = tiled_head_sample(hidden, weight, plan, chunk, shard=2, rows=rows, positions=positions, tile=32)
        assert_same_targets(got, expected, chunk)


# --- the Triton kernels, interpreted -------------------------------------------------------------------------

@pytest.fixture
def triton_kernels():
    pytest.importorskip("triton")
    from kdflow.tasks.teacher.sample_tile_kernel import TRITON_KERNELS

    return TRITON_KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_kernels_compute_the_torch_forms_tile_stats_and_keys(triton_kernels, scheme: str,
                                                                 dtype: torch.dtype) -> None:
    stats, keys_of = triton_kernels
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(5, 1000, generator=gen) * 3).to(dtype)
    logits[2, 64:96] = -torch.inf  # a whole tile of impossible ids
    words = stream_words(streams_of(5, seed))
    got, want = stats(logits, words, scheme, 32), sample_tile_stats_torch(logits, words, scheme, 32)
    assert torch.equal(got[0], want[0]), seed  # the max is exact
    for name, a, b in zip(("sum", "key max"), got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=lambda m, n=name: f"{n} (seed {seed}): {m}")
    picked = torch.randint(0, 32, (5, 6), generator=gen)  # tile 31 reaches past the vocabulary
    got_keys, want_keys = keys_of(logits, words, picked, scheme, 32), tile_keys_torch(logits, words, picked, scheme, 32)
    assert torch.equal(torch.isfinite(got_keys), torch.isfinite(want_keys)), seed
    finite = torch.isfinite(want_keys)
    torch.testing.assert_close(got_keys[finite], want_keys[finite], rtol=2e-6, atol=2e-6,
                               msg=lambda m: f"{seed}: {m}")


def test_the_sampler_on_the_kernels_draws_the_same_targets(triton_kernels) -> None:
    """Fixed inputs: the kernels' log may differ from torch's in the last bit, which may swap two keys that close."""
    logits = torch.randn(7, 800, generator=torch.Generator().manual_seed(11)) * 3
    for scheme in SCHEMES:
        plan = SamplingPlan(head=10, samples=12, scheme=scheme, seed=2)
        streams = streams_of(7)
        assert_same_targets(tiled_sample(logits, plan, streams, 32, kernels=triton_kernels),
                            tiled_sample(logits, plan, streams, 32), scheme)
