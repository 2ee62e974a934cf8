"""The expert check of a 4-bit teacher (`experts_left_unquantised`) reads what the model holds: it passes a teacher
loaded as the pass loads it and fails one whose experts were left in 16 bits on purpose (bitsandbytes alone, as
transformers 5 does without kdflow's hook), so `kdflow bench gpu`'s `teacher_weights_4bit` step can fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdflow.schemas.config import TeacherConfig
from kdflow.tasks.common.fused_experts import experts_left_unquantised
from kdflow.tasks.common.teacher_loading import load_teacher

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.unit


def test_a_teacher_loaded_in_4bit_as_the_pass_loads_it_holds_no_floating_expert_weight(
        tiny_moe_teacher_dir: Path) -> None:
    model = load_teacher(TeacherConfig(model=str(tiny_moe_teacher_dir), device="cpu", dtype="bfloat16",
                                       load_in_4bit=True))
    assert experts_left_unquantised(model) == []
    packed = model.get_submodule("model.layers.0.mlp.experts").parametrizations["gate_up_proj"].original
    assert packed.dtype == torch.uint8  # held packed; the bf16 read-back is no weight held


def test_experts_left_in_bf16_by_bitsandbytes_alone_are_each_reported(tiny_moe_teacher_dir: Path) -> None:
    """bitsandbytes replaces nn.Linear layers only: the attention is 4-bit, the fused 3-D experts stay bf16."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantisation = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_teacher_dir, quantization_config=quantisation,
                                                 dtype=torch.bfloat16, device_map="cpu")
    assert type(model.get_submodule("model.layers.0.self_attn.q_proj")).__name__ == "Linear4bit"
    assert experts_left_unquantised(model) == [f"model.layers.{layer}.mlp.experts.{name}"
                                               for layer in (0, 1) for name in ("gate_up_proj", "down_proj")]


def test_per_expert_linear_layers_left_in_16_bits_are_reported_and_routers_are_not() -> None:
    """transformers 4 kept one nn.Linear per expert (2-D weights under `experts.N`); the router's weight, outside
    the experts, is meant to stay in 16 bits and is never reported."""
    from torch import nn

    block = nn.Module()
    block.gate = nn.Linear(8, 4, bias=False, dtype=torch.bfloat16)
    block.experts = nn.ModuleList(nn.Linear(8, 16, bias=False, dtype=torch.float16) for _ in range(4))
    block.experts[2].weight = nn.Parameter(torch.zeros(16 * 8 // 2, 1, dtype=torch.uint8), requires_grad=False)
    assert experts_left_unquantised(block) == ["experts.0.weight", "experts.1.weight", "experts.3.weight"]
