"""The tiny teachers pruning is tested on (a Llama and a Qwen3-MoE with one dense block, built from configs) and the
depth reference: the teacher itself with blocks cut out of its module list."""

from __future__ import annotations

import copy

import torch
from torch import nn

SHAPES = dict(vocab_size=256, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64)


def tiny(kind: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**SHAPES)
    else:  # block 1 has a dense MLP, the others experts: the pruned config must keep each block's kind
        config = transformers.Qwen3MoeConfig(**SHAPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                             mlp_only_layers=[1])
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def cut_reference(teacher: nn.Module, kept: tuple[int, ...]) -> nn.Module:
    """The teacher itself with the other blocks removed from its module list (no config surgery, no copying)."""
    reference = copy.deepcopy(teacher)
    reference.model.layers = nn.ModuleList([reference.model.layers[index] for index in kept])
    reference.config.num_hidden_layers = len(kept)
    return reference
