"""Chunked teacher top-K on whole (tiny) models: body hidden states + chunked top-K equal the model's own logits;
final logit transforms; bitsandbytes 4-bit heads on CPU. (The kernel against a dense reference: test_topk.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.topk import HIDDEN, VOCAB, dense_tail, random_head, random_hidden
from torch import Tensor, nn

from kdflow.tasks.common.models import body_hidden_states, output_layer
from kdflow.tasks.common.models import LogitTransform, final_logit_transform
from kdflow.tasks.teacher.topk import TeacherTopkStep, chunked_topk


# ---- whole (tiny) models: body hidden states + chunked top-K == the model's own logits -----------------

TINY_DECODER = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128,
)


def tiny_config(kind: str) -> object:
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**TINY_DECODER)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **TINY_DECODER, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
        )
    if kind == "gemma2_softcap":
        return transformers.Gemma2Config(**TINY_DECODER, head_dim=16, final_logit_softcapping=1.5)
    if kind == "cohere_scale":
        return transformers.CohereConfig(**TINY_DECODER, logit_scale=0.5)
    if kind == "granite_scaling":
        return transformers.GraniteConfig(**TINY_DECODER, logits_scaling=2.0)
    raise AssertionError(kind)


def tiny_model(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    with torch.no_grad():
        # Random init gives near-uniform logits; sharpen them so top-K order and transforms really matter.
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def model_reference(model: nn.Module, input_ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        logits = model(input_ids).logits  # (B, T, V)
    top = torch.log_softmax(logits.double(), dim=-1).topk(k, dim=-1)
    return top.indices, top.values


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma2_softcap", "cohere_scale", "granite_scaling"])
def test_tiny_model_teacher_step_equals_full_logits(kind: str) -> None:
    model = tiny_model(kind)
    input_ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(1))
    vocab_chunk = 200 if kind == "llama" else None  # slabs through the whole-model path too
    topk_ids, topk_logprobs, tail_logprob = TeacherTopkStep(model, k=16, chunk_tokens=7,
                                                            vocab_chunk=vocab_chunk)(input_ids)
    ref_ids, ref_logprobs = model_reference(model, input_ids, 16)
    assert topk_ids.shape == (3, 11, 16) and tail_logprob.shape == (3, 11) and tail_logprob.dtype == torch.float32
    assert torch.equal(topk_ids.long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids).logits.double(), dim=-1)  # (B, T, V)
    torch.testing.assert_close(tail_logprob.double(), dense_tail(full, topk_ids), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma2_softcap"])
def test_the_tiled_head_gives_the_model_its_own_top_k(kind: str) -> None:
    """`precompute.head: tiled` on whole models; a head it cannot take (soft-capping) keeps the slab loop."""
    model = tiny_model(kind)
    input_ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(2))
    step = TeacherTopkStep(model, k=16, chunk_tokens=7, head="tiled")
    assert step.head == ("slab" if kind == "gemma2_softcap" else "tiled")
    topk_ids, topk_logprobs, tail_logprob = step(input_ids)
    ref_ids, ref_logprobs = model_reference(model, input_ids, 16)
    assert torch.equal(topk_ids.long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids).logits.double(), dim=-1)
    torch.testing.assert_close(tail_logprob.double(), dense_tail(full, topk_ids), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_body_hidden_states_then_chunked_topk(kind: str) -> None:
    """The call the precompute worker makes, spelled out."""
    model = tiny_model(kind)
    input_ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    hidden = body_hidden_states(model, input_ids)  # (B, T, H)
    assert hidden.shape == (2, 9, 64)
    topk_ids, topk_logprobs = chunked_topk(hidden.flatten(0, 1), output_layer(model), 8, 5)
    ref_ids, ref_logprobs = model_reference(model, input_ids, 8)
    assert torch.equal(topk_ids.view(2, 9, 8).long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.view(2, 9, 8).double(), ref_logprobs, atol=1e-5, rtol=0)


def test_final_logit_transform_reads_config() -> None:
    assert final_logit_transform(tiny_config("llama")) == LogitTransform()
    assert final_logit_transform(tiny_config("gemma2_softcap")) == LogitTransform(softcap=1.5)
    assert final_logit_transform(tiny_config("cohere_scale")) == LogitTransform(scale=0.5)
    assert final_logit_transform(tiny_config("granite_scaling")) == LogitTransform(scale=0.5)


def test_unsupported_final_logit_change_is_named() -> None:
    from transformers import MptConfig

    with pytest.raises(NotImplementedError, match="logit_scale"):
        final_logit_transform(MptConfig(logit_scale=2.0))


def test_model_without_body_or_head_is_a_clear_error() -> None:
    body_only = tiny_model("llama").model  # LlamaModel: no lm_head, and no body below it
    with pytest.raises(ValueError, match="output embeddings"):
        output_layer(body_only)
    with pytest.raises(ValueError, match="cannot find the body"):
        body_hidden_states(nn.Linear(2, 2), torch.zeros(1, 1, dtype=torch.long))


# ---- bitsandbytes 4-bit (runs on CPU) ------------------------------------------------------------------


def test_quantised_linear4bit_head_is_called_as_a_module() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    head = random_head(10, bias=False)
    quantised = bnb.nn.Linear4bit(HIDDEN, VOCAB, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    quantised.weight = bnb.nn.Params4bit(head.weight.detach().clone(), requires_grad=False, quant_type="nf4")
    quantised = quantised.to("cpu")  # quantises the weight
    assert quantised.weight.dtype == torch.uint8
    hidden = random_hidden(25)
    topk_ids, topk_logprobs = chunked_topk(hidden, quantised, 10, 6)
    with torch.no_grad():
        logits = quantised(hidden)  # (N, V): the dequantised weight, as the module computes it
    ref = torch.log_softmax(logits.double(), dim=-1).topk(10, dim=-1)
    assert torch.equal(topk_ids.long(), ref.indices)
    torch.testing.assert_close(topk_logprobs.double(), ref.values, atol=1e-5, rtol=0)


def test_bitsandbytes_4bit_tiny_llama(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
        device_map={"": "cpu"},
    ).eval()
    assert any(type(module).__name__ == "Linear4bit" for module in model.modules())
    input_ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(3))
    topk_ids, topk_logprobs, _ = TeacherTopkStep(model, k=12, chunk_tokens=5)(input_ids)
    ref_ids, ref_logprobs = model_reference(model, input_ids, 12)
    assert torch.equal(topk_ids.long(), ref_ids)
    torch.testing.assert_close(topk_logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)


def test_the_gguf_loaders_own_bar_is_off_while_a_teacher_loads(capfd: pytest.CaptureFixture[str]) -> None:
    """transformers dequantises a GGUF under a tqdm bar that cut through a training run's log lines on a terminal."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    from kdflow.tasks.common.teacher_loading import no_gguf_bar

    bar = gguf_loading.tqdm
    with no_gguf_bar():
        for _ in gguf_loading.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert gguf_loading.tqdm is bar and "Converting" not in capfd.readouterr().err
    for _ in gguf_loading.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
        pass
    assert "Converting" in capfd.readouterr().err  # outside it, the loader's bar as transformers draws it
