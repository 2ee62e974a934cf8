"""The teacher's sampler: the noise hash, exactness against a dense reference, slabs, chunks, ties, errors."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from torch import Tensor, nn

from kdflow.schemas.config import PrecomputeConfig
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.sampled_settings import SCHEMES
from kdflow.tasks.common.sampled import SampledTargets, cat_targets
from kdflow.tasks.teacher.sampled_step import TeacherSampledStep
from kdflow.tasks.teacher.sampling import SamplingPlan, check_sampling_fits, chunked_sampled, sample_slabs
from kdflow.schemas.sampled_settings import HASH_VERSIONS
from kdflow.tasks.teacher.sampling_noise import (mix32_, mix64_, position_streams, stream_words, token_keys,
                                                 token_keys32, uniform_noise32_, uniform_noise_)

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
FIELDS = [f.name for f in fields(SampledTargets)]


def python_mix64(z: int) -> int:
    """splitmix64's finaliser on unsigned Python integers: the reference for the int64 tensor version."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def python_mix32(z: int) -> int:
    """kdflow.2's 32-bit hash on unsigned Python integers."""
    z &= MASK32
    z = ((z ^ (z >> 16)) * 0x7FEB352D) & MASK32
    z = ((z ^ (z >> 15)) * 0x846CA68B) & MASK32
    return z ^ (z >> 16)


def python_uniform32(stream: int, token_id: int) -> float:
    """kdflow.2's uniform of (a position's 64-bit stream, an id), written from its definition."""
    return ((python_mix32((stream & MASK32) ^ python_mix32(token_id ^ 0x9E3779B9)) >> 9) + 0.5) * 2.0**-23


def noise(streams: Tensor, first_id: int, width: int, version: str = "kdflow.1") -> Tensor:
    if version == "kdflow.1":
        bits = torch.empty(streams.shape[0], width, dtype=torch.int64)
        return uniform_noise_(streams, token_keys(first_id, width, streams.device), bits,
                              torch.empty_like(bits)).clone()
    bits = torch.empty(streams.shape[0], width, dtype=torch.int32)
    return uniform_noise32_(stream_words(streams), token_keys32(first_id, width, streams.device), bits,
                            torch.empty_like(bits)).clone()


def dense_uniform(streams: Tensor, width: int, version: str) -> Tensor:
    """Every (position, id)'s uniform (N, V) float64, by the Python references (kdflow.1 through the tested tensor
    hash, checked against its reference above)."""
    if version == "kdflow.1":
        return noise(streams, 0, width)
    return torch.tensor([[python_uniform32(int(stream), j) for j in range(width)] for stream in streams.tolist()],
                        dtype=torch.float64)


def sample_logits(logits: Tensor, plan: SamplingPlan, vocab_chunk: int, shard: int = 7,
                  rows: Tensor | None = None) -> SampledTargets:
    """Targets straight from float32 logits (N, V), cut into slabs of vocab_chunk ids."""
    n, vocab = logits.shape
    rows = torch.zeros(n, dtype=torch.long) if rows is None else rows
    streams = position_streams(plan.seed, shard, rows, torch.arange(n))
    slabs = ((first, logits[:, first:first + vocab_chunk]) for first in range(0, vocab, vocab_chunk))
    return sample_slabs(slabs, plan, streams, vocab)


def assert_same(a: SampledTargets, b: SampledTargets, context: object = None) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), (name, context)


def assert_same_draw(a: SampledTargets, b: SampledTargets) -> None:
    """The same ids; values within float32 rounding (a model's body rounds differently for another batch size)."""
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y) if name.endswith("_ids") else torch.allclose(x, y, rtol=0, atol=1e-5), name


def test_hash_matches_an_unsigned_python_reference() -> None:
    values = [0, 1, 2, 12345, -1, -(1 << 63), (1 << 63) - 1, 0x6B64666C6F772E31, -987654321987]
    got = mix64_(torch.tensor(values, dtype=torch.int64))
    assert [v & MASK64 for v in got.tolist()] == [python_mix64(v) for v in values]
    stream = int(position_streams(11, 3, torch.tensor([5]), torch.tensor([9]))[0]) & MASK64
    expected_u = ((python_mix64(stream ^ python_mix64(42 ^ 0x9E3779B97F4A7C15)) >> 12) + 0.5) * 2.0**-52
    signed = stream - (1 << 64) if stream >= 1 << 63 else stream
    assert noise(torch.tensor([signed]), 40, 5)[0, 2].item() == expected_u


def test_the_32_bit_hash_matches_an_unsigned_python_reference() -> None:
    values = [0, 1, 2, 12345, -1, -(1 << 31), (1 << 31) - 1, 0x6B64666C, -987654321]
    got = mix32_(torch.tensor(values, dtype=torch.int32))
    assert [v & MASK32 for v in got.tolist()] == [python_mix32(v) for v in values]
    streams = position_streams(11, 3, torch.tensor([5, 6, 7]), torch.tensor([9, 9, 0]))
    got = noise(streams, 40, 5, "kdflow.2")
    assert got.dtype == torch.float32
    for row, stream in enumerate(streams.tolist()):
        assert got[row].tolist() == [python_uniform32(stream, j) for j in range(40, 45)]


@pytest.mark.parametrize("version", HASH_VERSIONS)
def test_noise_does_not_depend_on_the_cut_and_depends_on_seed_and_shard(version: str) -> None:
    rows, positions = torch.arange(12) // 4, torch.arange(12) % 4 + 100
    streams = position_streams(5, 1, rows, positions)  # (12,)
    whole = noise(streams, 0, 50, version)  # (12, 50)
    assert bool(((whole > 0) & (whole < 1)).all())
    assert torch.equal(noise(streams[3:7], 10, 13, version), whole[3:7, 10:23])
    assert torch.equal(position_streams(5, 1, rows[5:], positions[5:]), streams[5:])
    assert not torch.equal(position_streams(6, 1, rows, positions), streams)
    assert not torch.equal(position_streams(5, 2, rows, positions), streams)
    assert streams.unique().numel() == 12


def identity_head(logits: Tensor) -> tuple[Tensor, Tensor]:
    """hidden = the logits and lm_head = the identity: the pass then sees exactly these logits."""
    return logits, torch.eye(logits.shape[1], dtype=logits.dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("head", "samples"), [(16, 8), (0, 12), (5, 45), (49, 1)])
@pytest.mark.parametrize("version", HASH_VERSIONS)
def test_slabs_chunks_and_micro_batches_give_the_same_targets(scheme: str, head: int, samples: int,
                                                              version: str) -> None:
    logits = torch.randn(13, 50, generator=torch.Generator().manual_seed(1)) * 3
    plan = SamplingPlan(head=head, samples=samples, scheme=scheme, seed=3, hash_version=version)
    rows, positions = torch.arange(13) // 4, torch.arange(13) % 4
    hidden, weight = identity_head(logits)
    whole = chunked_sampled(hidden, weight, plan, 64, shard=2, rows=rows, positions=positions)
    for vocab_chunk, chunk_tokens in [(1, 13), (3, 5), (7, 1), (16, 4), (49, 13), (50, 2)]:
        cut = chunked_sampled(hidden, weight, plan, chunk_tokens, shard=2, rows=rows, positions=positions,
                              vocab_chunk=vocab_chunk)
        assert_same(cut, whole, (vocab_chunk, chunk_tokens))
    halves = [chunked_sampled(hidden[part], weight, plan, 4, shard=2, rows=rows[part], positions=positions[part],
                              vocab_chunk=9) for part in (slice(0, 6), slice(6, 13))]
    assert_same(cat_targets(halves), whole, "micro-batches")


def test_ties_go_to_the_lower_id_whatever_the_slabs() -> None:
    logits = torch.randint(-3, 3, (9, 40), generator=torch.Generator().manual_seed(2)).float()
    logits[4] = 0.0  # a row of equal logits
    logits[5, 10:] = -torch.inf  # ids with p = 0
    plan = SamplingPlan(head=7, samples=20, seed=0)
    whole = sample_logits(logits, plan, 40)
    for vocab_chunk in (1, 6, 13):
        assert_same(sample_logits(logits, plan, vocab_chunk), whole, vocab_chunk)
    assert whole.head_ids[4].tolist() == list(range(7))
    for row in range(9):
        order = sorted(range(40), key=lambda j: (-float(logits[row, j]), j))
        assert whole.head_ids[row].tolist() == order[:7]
    assert int((whole.sample_logprobs[5] > -torch.inf).sum()) == 3  # 10 finite ids - 7 in the head
    assert whole.log_threshold[5] == -torch.inf  # no more than S finite tail ids


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("version", HASH_VERSIONS)
def test_head_tail_mass_and_samples_match_a_dense_float64_reference(version: str, scheme: str) -> None:
    logits = torch.randn(11, 60, generator=torch.Generator().manual_seed(3)) * 2
    out = sample_logits(logits, SamplingPlan(head=9, samples=10, seed=4, scheme=scheme, hash_version=version), 17)
    log_p = torch.log_softmax(logits.double(), 1)  # (N, V) float64
    top = log_p.topk(9, dim=1)
    assert torch.equal(out.head_ids.long(), top.indices)
    torch.testing.assert_close(out.head_logprobs.double(), top.values, rtol=0, atol=1e-6)
    in_head = torch.zeros_like(log_p, dtype=torch.bool).scatter_(1, top.indices, True)
    tail = log_p.masked_fill(in_head, -torch.inf).logsumexp(1)
    torch.testing.assert_close(out.tail_logprob.double(), tail, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.sample_logprobs.double(), log_p.gather(1, out.sample_ids.long()), rtol=0, atol=1e-6)
    assert not bool(in_head.gather(1, out.sample_ids.long()).any())
    assert all(len(set(r)) == 10 for r in out.sample_ids.tolist())
    # The sample is the S largest tail keys and the threshold the next one: recompute the keys densely.
    streams = position_streams(4, 7, torch.zeros(11, dtype=torch.long), torch.arange(11))
    exp_noise = -dense_uniform(streams, 60, version).log()
    keys = logits.double() + (exp_noise if scheme == "priority" else -exp_noise.log())
    ranked = keys.masked_fill(in_head, -torch.inf).topk(11, dim=1)
    assert torch.equal(out.sample_ids.long(), ranked.indices[:, :10])
    lse = torch.logsumexp(logits.double(), 1)
    # kdflow.2's keys are float32: the threshold within their rounding
    atol = 1e-6 if version == "kdflow.1" else 1e-5
    torch.testing.assert_close(out.log_threshold.double(), ranked.values[:, 10] - lse, rtol=0, atol=atol)


def test_a_tiny_teacher_step_equals_the_pass_on_its_hidden_states(tiny_teacher_dir) -> None:
    from transformers import AutoModelForCausalLM

    from kdflow.tasks.common.models import body_hidden_states

    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    plan = SamplingPlan(head=4, samples=6, scheme="gumbel", seed=9)
    input_ids = torch.randint(0, 384, (3, 16), generator=torch.Generator().manual_seed(0))
    step = TeacherSampledStep(model, plan, chunk_tokens=10, vocab_chunk=100)
    out = step(input_ids, shard=5, first_row=8)  # rows 8, 9, 10 of shard 5
    assert (out.head_ids.shape == (3, 16, 4) and out.sample_ids.shape == (3, 16, 6)
            and out.log_threshold.shape == (3, 16))
    hidden = body_hidden_states(model, input_ids).flatten(0, 1)
    rows, positions = (torch.arange(3) + 8).repeat_interleave(16), torch.arange(16).repeat(3)
    # the same cut as the step: a real lm_head's matmul may round differently for another number of rows (the
    # draw's independence of the cut is tested above, on exact logits)
    direct = chunked_sampled(hidden, model.lm_head, plan, 10, shard=5, rows=rows, positions=positions, vocab_chunk=100)
    assert_same(out.flatten_positions(), direct)
    later = step(input_ids[1:], shard=5, first_row=9)  # the same rows in another micro-batch: the same draw
    assert_same_draw(later, out.map(lambda t: t[1:]))
    other_shard = step(input_ids, shard=6, first_row=8)
    assert torch.equal(other_shard.head_ids, out.head_ids) and not torch.equal(other_shard.sample_ids, out.sample_ids)


@pytest.mark.parametrize(("head", "samples", "message"), [
    (16, 40, "precompute.sampling.head + samples = 16 + 40 must be <= the teacher's vocabulary size 50"),
    (16, 0, "precompute.sampling.samples must be >= 1"), (-1, 4, "precompute.sampling.head must be >= 0")])
def test_bad_sizes_raise_one_line_naming_the_setting(head: int, samples: int, message: str) -> None:
    hidden, weight = identity_head(torch.randn(2, 50))
    with pytest.raises(ValueError) as error:
        chunked_sampled(hidden, weight, SamplingPlan(head=head, samples=samples), 4, shard=0,
                        rows=torch.zeros(2, dtype=torch.long), positions=torch.arange(2))
    assert "\n" not in str(error.value) and str(error.value).startswith(message)


def test_pre_flight_checks_the_config_against_the_teacher_vocabulary() -> None:
    hybrid = PrecomputeConfig(targets="hybrid", sampling={"head": 16, "samples": 24})
    check_sampling_fits(hybrid, 40)  # H + S = V is allowed: the whole tail is then sampled
    with pytest.raises(ConfigError, match=r"^precompute.sampling.head \+ samples = 16 \+ 24 must be <= .* 39$"):
        check_sampling_fits(hybrid, 39)
    sampled = PrecomputeConfig(targets="sampled", sampling={"head": 16, "samples": 24})
    check_sampling_fits(sampled, 24)  # sampled targets have no head
    assert SamplingPlan.from_config(sampled).kind == "sampled" and SamplingPlan.from_config(hybrid).head == 16
    check_sampling_fits(PrecomputeConfig(), 5)  # top-K targets: nothing to check here


def test_non_finite_logits_are_an_error() -> None:
    logits = torch.randn(3, 20)
    logits[1, 4] = torch.nan
    with pytest.raises(ValueError, match="NaN"):
        sample_logits(logits, SamplingPlan(head=2, samples=3), 7)


class _Doubling(nn.Module):
    """A non-Linear lm_head (as a quantised one is): called whole, never cut into slabs."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden @ self.weight.T


def test_a_module_lm_head_gives_the_same_targets_as_its_weight() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(10, 8, generator=gen), torch.randn(30, 8, generator=gen)
    plan = SamplingPlan(head=3, samples=5, seed=1)
    rows, positions = torch.zeros(10, dtype=torch.long), torch.arange(10)
    assert_same(chunked_sampled(hidden, _Doubling(weight), plan, 4, shard=0, rows=rows, positions=positions),
                chunked_sampled(hidden, weight, plan, 4, shard=0, rows=rows, positions=positions))
