"""`teacher.lm_head_float32`: a bf16 teacher's logits computed in float32 from its (bf16) hidden states. Against a
float64 reference on the same hidden states and weights, the stored log-probabilities and tail move by ~1e-3
nats in bf16 and by float32 rounding with the option; the sampler takes the same path; the fingerprint says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import ConfigError
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
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    assert torch.equal(head.weight, output_layer(plain).weight.float())  # a copy: bf16 values are float32 values
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
    ids, _ = chunked_topk(hidden, output_layer(model), K, 5)
    assert torch.equal(ids, chunked_topk(hidden.float(), output_layer(model), K, 5)[0])


def test_the_option_is_in_the_teachers_fingerprint_only_when_on(tiny_teacher_dir: Path) -> None:
    off = teacher_fingerprint(_config(tiny_teacher_dir, False))
    on = teacher_fingerprint(_config(tiny_teacher_dir, True))
    assert off != on
    assert off == teacher_fingerprint(TeacherConfig(model=str(tiny_teacher_dir), device="cpu", dtype="bfloat16"))


def test_a_quantised_lm_head_is_a_one_line_error(tiny_teacher_dir: Path) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    model = load_teacher(_config(tiny_teacher_dir, False))
    head = output_layer(model)
    model.set_output_embeddings(bnb.nn.Linear4bit(head.in_features, head.out_features, bias=False))
    with pytest.raises(ConfigError, match=r"^teacher.lm_head_float32 needs a plain nn.Linear lm_head, not Linear4bit"):
        float32_lm_head(model)
