"""`teacher.lm_head_float32` (on by default): a bf16 teacher's logits computed in float32 from its (bf16) hidden
states and weight, never rounded to bf16 (`Float32Logits`, no copy of the weight). Against a float64 reference on
the same hidden states and weights, the stored log-probabilities and tail move by ~1e-3 nats in bf16 and by
float32 rounding with the option; the sampler takes the same path; the fingerprint says so where it matters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdflow.schemas.config import TeacherConfig
from kdflow.tasks.common.float32_logits import Float32Logits, float32_logits
from kdflow.tasks.common.models import body_hidden_states, output_layer, teacher_fingerprint
from kdflow.tasks.common.teacher_loading import float32_lm_head, load_teacher
from kdflow.tasks.teacher.topk import TeacherTopkStep, chunked_topk

K = 16


def _config(folder: Path, on: bool) -> TeacherConfig:
    return TeacherConfig(model=str(folder), device="cpu", dtype="bfloat16", lm_head_float32=on)


def _reference(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-K ids, log-probs and tail log-mass in float64 from the model's bf16 hidden states and bf16 weight."""
    with torch.no_grad():
        hidden = body_hidden_states(model, input_ids).flatten(0, 1).double()
        logprobs = torch.log_softmax(hidden @ output_layer(model).weight.double().T, dim=-1)
    top = logprobs.topk(K, dim=-1)
    tail = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-12))
    return top.indices, top.values, tail


@pytest.mark.parametrize("teacher", ["tiny_teacher_dir", "tiny_moe_teacher_dir"])
def test_float32_logits_match_a_float64_reference_where_bf16_logits_do_not(
        teacher: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(teacher)
    plain, upcast = load_teacher(_config(folder, False)), load_teacher(_config(folder, True))
    head = output_layer(upcast)
    assert type(head) is Float32Logits and head.weight.dtype == torch.bfloat16  # the weight as it was: no copy
    assert torch.equal(head.weight, output_layer(plain).weight)
    input_ids = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(4))
    ref_ids, ref_logprobs, ref_tail = _reference(plain, input_ids)
    errors = {}
    for name, model in (("bf16", plain), ("float32", upcast)):
        ids, logprobs, tail = TeacherTopkStep(model, K, chunk_tokens=7)(input_ids)
        value_error = (logprobs.flatten(0, 1).double() - ref_logprobs).abs().max().item()
        tail_error = (tail.flatten().double() - ref_tail).abs().max().item()
        errors[name] = (value_error, tail_error, torch.equal(ids.flatten(0, 1).long(), ref_ids))
    assert errors["float32"][0] < 2e-5 and errors["float32"][1] < 2e-5 and errors["float32"][2], errors
    assert errors["bf16"][0] > 10 * errors["float32"][0], errors  # what the option is for
    with torch.no_grad():  # the model's own forward: the same float32 logits (its input is upcast)
        logits = upcast(input_ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(torch.log_softmax(logits.flatten(0, 1).double(), -1).gather(-1, ref_ids), ref_logprobs,
                               atol=2e-5, rtol=0)


def test_the_sampler_upcasts_the_same_way(tiny_teacher_dir: Path) -> None:
    """Chunks of bf16 hidden states against a float32 head give what float32 hidden states give."""
    from kdflow.schemas.config import PrecomputeConfig
    from kdflow.tasks.teacher.sampling import SamplingPlan, chunked_sampled

    model = load_teacher(_config(tiny_teacher_dir, True))
    hidden = torch.randn(24, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    plan = SamplingPlan.from_config(PrecomputeConfig(targets="hybrid"))
    rows, positions = torch.arange(24) // 8, torch.arange(24) % 8
    got = chunked_sampled(hidden, output_layer(model), plan, 5, shard=0, rows=rows, positions=positions)
    expected = chunked_sampled(hidden.float(), output_layer(model), plan, 5, shard=0, rows=rows, positions=positions)
    for field in ("head_ids", "head_logprobs", "tail_logprob", "sample_ids", "sample_logprobs", "log_threshold"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
    ids, values = chunked_topk(hidden, output_layer(model), K, 5)
    assert torch.equal(ids, chunked_topk(hidden.float(), output_layer(model), K, 5)[0])
    sliced = chunked_topk(hidden, output_layer(model), K, 5, vocab_chunk=64)  # slabs of the vocabulary, merged
    assert torch.equal(sliced[0], ids) and torch.allclose(sliced[1], values, atol=1e-6, rtol=0)


def test_the_option_is_in_the_teachers_fingerprint_only_where_it_changes_the_logits(tiny_teacher_dir: Path) -> None:
    """On (the default) for a bf16 teacher: another fingerprint than off; for a float32 teacher it changes
    nothing, and neither does its fingerprint (so a float32 teacher's stores made before the option still match)."""
    off = teacher_fingerprint(_config(tiny_teacher_dir, False))
    on = teacher_fingerprint(_config(tiny_teacher_dir, True))
    assert off != on
    assert on == teacher_fingerprint(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="bfloat16"))
    float32 = {flag: teacher_fingerprint(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="float32",
                                                       lm_head_float32=flag)) for flag in (False, True)}
    assert float32[False] == float32[True]


def test_a_head_it_cannot_wrap_is_left_as_it_is(tiny_teacher_dir: Path) -> None:
    """A quantised lm_head computes its own logits and a float32 one needs nothing: the option (on by default)
    leaves both, so it never stops a teacher from loading."""
    bnb = pytest.importorskip("bitsandbytes")
    model = load_teacher(_config(tiny_teacher_dir, False))
    head = output_layer(model)
    quantised = bnb.nn.Linear4bit(head.in_features, head.out_features, bias=False)
    model.set_output_embeddings(quantised)
    assert not float32_lm_head(model) and output_layer(model) is quantised
    float32_model = load_teacher(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="float32"))
    assert type(output_layer(float32_model)) is torch.nn.Linear  # on by default, nothing to do
    with pytest.raises(TypeError, match="wraps a bf16/fp16 nn.Linear"):
        Float32Logits(output_layer(float32_model))


def test_float32_logits_match_a_float64_product_with_and_without_bias() -> None:
    """The upcast path (this CPU has no 16-bit matmul with float32 output) against float64, and the reused buffer."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 16, generator=generator).bfloat16()
    weight, bias = torch.randn(7, 16, generator=generator).bfloat16(), torch.randn(7, generator=generator).bfloat16()
    expected = hidden.double() @ weight.double().T + bias.double()
    buffer = torch.empty(5, 7)
    got = float32_logits(hidden, weight, bias, out=buffer)
    assert got.dtype == torch.float32 and got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(float32_logits(hidden, weight).double(), expected - bias.double(), atol=1e-5, rtol=1e-6)


def test_the_precision_measurement_against_a_float64_reference() -> None:
    """`logits_precision_measure.precision` (what set the option's default) on peaked logits: its KL of
    bf16 logits, its KL of float32 logits merely rounded, and its top-K overlap, each against float64 written
    here; the float32 path equals the exact top-K on this CPU."""
    from kdflow.bench.logits_precision_measure import precision

    generator = torch.Generator().manual_seed(3)
    hidden = (3 * torch.randn(48, 32, generator=generator)).bfloat16()
    head = torch.nn.Linear(32, 500, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(500, 32, generator=generator))  # logits of ~17: a trained teacher's size
    got = precision(hidden, head, top_k=8)

    exact_logits = hidden.double() @ head.weight.double().T
    exact = torch.log_softmax(exact_logits, -1)

    def kl(logits: torch.Tensor) -> float:
        other = torch.log_softmax(logits.double(), -1)
        return (exact.exp() * (exact - other)).sum(-1).mean().item()

    with torch.no_grad():
        rounded_matmul = hidden @ head.weight.T  # bf16 output, as a bf16 lm_head gives
    assert got["kl_mean_nats"] == pytest.approx(kl(rounded_matmul), rel=1e-3)
    assert got["rounding_only_kl_mean_nats"] == pytest.approx(kl(exact_logits.bfloat16()), rel=0.05)
    assert got["kl_mean_nats"] > 1e-4  # peaked logits: rounding costs real KL
    ours = torch.log_softmax(rounded_matmul.double(), -1).topk(8).indices
    overlap = [len(set(a.tolist()) & set(b.tolist())) / 8 for a, b in zip(exact.topk(8).indices, ours, strict=True)]
    assert got["topk_id_overlap_mean"] == pytest.approx(sum(overlap) / len(overlap))
    cost = got["lm_head_float32"]
    assert cost["float32_vs_exact_logprob_max_abs_diff"] == 0 and cost["float32_vs_exact_id_overlap_mean"] == 1
    assert got["recommend_lm_head_float32"] == (got["kl_mean_nats"] > got["codec_budget_nats"])
