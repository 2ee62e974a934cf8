"""4-bit teachers whose MoE experts are fused 3-D parameters (transformers 5): every expert weight is quantised, as
it loads, to exactly the bytes per-expert `Linear4bit` layers held (transformers 4), and the forward computes
with them. (bitsandbytes alone replaces nn.Linear layers only and would leave the experts in 16 bits.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kdflow.schemas.config import TeacherConfig
from kdflow.tasks.common.fused_experts import expert_count, fused_expert_weights, weight_bytes
from kdflow.tasks.common.teacher_loading import load_teacher

pytest.importorskip("bitsandbytes")


def _teacher(folder: Path, four_bit: bool) -> nn.Module:
    return load_teacher(TeacherConfig(model=str(folder), device="cpu", dtype="float32", load_in_4bit=four_bit))


def _linear4bit_weight(weight: torch.Tensor) -> Any:
    """One expert's matrix as transformers 4 quantised it: a Linear4bit weight under the loader's settings."""
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4", compress_statistics=False).to("cpu")


def _experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if name.endswith("mlp.experts")]


def test_no_expert_weight_of_a_4bit_moe_teacher_stays_in_16_or_32_bits(tiny_moe_teacher_dir: Path) -> None:
    plain, model = _teacher(tiny_moe_teacher_dir, False), _teacher(tiny_moe_teacher_dir, True)
    expert_values = sum(getattr(module, name).numel() for _, module, name in fused_expert_weights(plain))
    linear4bit_values = sum(m.weight.numel() * 2 for m in model.modules() if type(m).__name__ == "Linear4bit")
    assert expert_values > 0 and fused_expert_weights(model) == []
    for _, experts in _experts(model):
        for name in ("gate_up_proj", "down_proj"):
            assert experts.parametrizations[name].original.dtype == torch.uint8
            assert getattr(experts, name).shape == getattr(plain.get_submodule(_experts(plain)[0][0]), name).shape
    sizes, plain_sizes = weight_bytes(model), weight_bytes(plain)
    assert sizes["4bit"] * 2 == expert_values + linear4bit_values  # two values a byte: every one accounted for
    states = 2 * len(_experts(model)) + sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    absmax = 4 * (expert_values + linear4bit_values) // 64  # a float32 scale a block of 64 (no double quant)
    assert absmax <= sizes["4bit_statistics"] <= absmax + 64 * states  # + each state's 16-entry code table
    # What stays float32: embeddings, lm_head, norms and the routers (4 bytes a value).
    assert sizes["float32"] == plain_sizes["float32"] - 4 * (expert_values + linear4bit_values)


def test_each_expert_holds_the_bytes_a_per_expert_linear4bit_holds(tiny_moe_teacher_dir: Path) -> None:
    """transformers 4 kept one nn.Linear per expert, which bitsandbytes quantised on its own: the fused weight
    quantised here stores, expert by expert, the same packed values and block scales (blocks never straddle)."""
    plain, model = _teacher(tiny_moe_teacher_dir, False), _teacher(tiny_moe_teacher_dir, True)
    for (name, experts), (_, plain_experts) in zip(_experts(model), _experts(plain), strict=True):
        for proj in ("gate_up_proj", "down_proj"):
            packed = experts.parametrizations[proj].original.flatten()
            state = experts.parametrizations[proj][0].quant_state
            weight = getattr(plain_experts, proj).detach()
            per_expert = packed.numel() // weight.shape[0]
            for e in range(weight.shape[0]):
                linear = _linear4bit_weight(weight[e])
                assert torch.equal(packed[e * per_expert:(e + 1) * per_expert], linear.data.flatten()), (name, e)
                blocks = linear.quant_state.absmax.numel()
                assert torch.equal(state.absmax[e * blocks:(e + 1) * blocks], linear.quant_state.absmax)


def _nf4_decode(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """NF4 read by hand: two values a byte (the first in the high nibble), each a code-table entry times its
    block's scale, a block being 64 consecutive values (in memory order, whatever the shape)."""
    flat = packed.flatten().long()
    index = torch.stack([flat >> 4, flat & 15], dim=1).flatten()[:shape.numel()]
    scale = absmax.float().repeat_interleave(64)[:shape.numel()]
    return (code.float()[index] * scale).view(shape)


def test_the_4bit_moe_computes_with_its_dequantised_weights(tiny_moe_teacher_dir: Path) -> None:
    """Its experts, decoded by hand from the stored bytes, are the float32 ones within NF4's rounding, and the
    logits equal those of the float32 model given those decoded experts and the 4-bit model's own Linear4bit
    attention (bitsandbytes' part, tested there)."""
    plain, model = _teacher(tiny_moe_teacher_dir, False), _teacher(tiny_moe_teacher_dir, True)
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if type(module).__name__ == "Linear4bit":
                plain.set_submodule(name, module)
        for (_, experts), (_, plain_experts) in zip(_experts(model), _experts(plain), strict=True):
            for proj in ("gate_up_proj", "down_proj"):
                weight, state = getattr(plain_experts, proj), experts.parametrizations[proj][0].quant_state
                decoded = _nf4_decode(experts.parametrizations[proj].original, state.absmax, state.code, weight.shape)
                half_gap = (state.code.float().sort().values.diff().max() / 2).item()
                bound = state.absmax.float().repeat_interleave(64)[:weight.numel()].view(weight.shape) * half_gap
                assert ((decoded - weight).abs() <= bound * (1 + 1e-5) + 1e-7).all()
                torch.testing.assert_close(getattr(experts, proj), decoded, atol=0, rtol=0)
                weight.copy_(decoded)
        input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        expected, got = plain(input_ids).logits, model(input_ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_experts_are_quantised_as_they_load_one_at_a_time(tiny_moe_teacher_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers loads one parameter at a time; each expert weight is quantised as soon as it is set, so
    never more than one sits on the device in 16 bits (the reference teacher's are ~1.2 GiB each, ~57 together)."""
    from transformers import core_model_loading

    from kdflow.tasks.common import fused_experts

    original, in_float = core_model_loading.set_param_for_module, []

    def counting(model: nn.Module, target_name: str, *args: Any, **kwargs: Any) -> Any:
        result = original(model, target_name, *args, **kwargs)
        in_float.append(len(fused_expert_weights(model)))  # just set, not yet quantised by the hook around this
        return result

    monkeypatch.setattr(core_model_loading, "set_param_for_module", counting)
    seen: list[list[str]] = []
    entered = fused_experts.quantising_fused_experts

    def recording(**options: Any) -> Any:
        context = entered(**options)
        names = context.__enter__()
        seen.append(names)

        class Wrapped:
            def __enter__(self) -> list[str]:
                return names

            def __exit__(self, *exc: Any) -> Any:
                return context.__exit__(*exc)
        return Wrapped()

    monkeypatch.setattr("kdflow.tasks.common.teacher_loading.quantising_fused_experts", recording)
    model = _teacher(tiny_moe_teacher_dir, True)
    layers = model.config.num_hidden_layers
    assert sorted(seen[0]) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in range(layers)
                                     for p in ("down_proj", "gate_up_proj"))
    assert max(in_float) == 1 and core_model_loading.set_param_for_module is counting  # the hook is gone again


def test_the_loaded_experts_are_never_dequantised_to_be_initialised(tiny_moe_teacher_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """After a load transformers initialises what the checkpoint did not hold. Read through the parametrization an
    expert weight would be dequantised whole for that (the reference's 1.9 GB a layer; 5 s a layer on this CPU)
    and random values drawn into the copy: the experts are marked loaded once both their weights are quantised."""
    from kdflow.tasks.common.fused_experts import Dequantised

    calls: list[int] = []
    original = Dequantised.forward
    monkeypatch.setattr(Dequantised, "forward", lambda self, packed: calls.append(1) or original(self, packed))
    model = _teacher(tiny_moe_teacher_dir, True)
    assert calls == [] and all(module._is_hf_initialized for _, module in _experts(model))
    model(input_ids=torch.arange(2, 6).unsqueeze(0))
    assert len(calls) == 2 * model.config.num_hidden_layers  # the forward dequantises each weight once


def test_expert_count_reads_the_configs_of_moe_families() -> None:
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    assert expert_count(Qwen3MoeConfig(num_experts=12)) == 12
    assert expert_count(MixtralConfig(num_local_experts=6)) == 6
    assert expert_count(LlamaConfig()) is None and expert_count(None) is None


def test_a_dense_4bit_teacher_has_no_fused_experts(tiny_teacher_dir: Path) -> None:
    model = _teacher(tiny_teacher_dir, True)
    assert fused_expert_weights(model) == [] and "4bit" in weight_bytes(model)
