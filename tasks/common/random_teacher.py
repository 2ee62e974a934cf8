"""A teacher with random weights, made from its config alone, on its device, as `load_teacher` would hold it.

What micro-batch fits a 24 GB card, and how fast the pass runs there, depends on the teacher's shapes, not on its
values: `kdflow tune precompute --random-weights` answers it before 60 GB of weights are downloaded, and the GPU
check answers it for the 32-layer reference without a checkpoint that would not fit the lent machine's disk. The
model is made on the meta device, then each part is given memory on the device and random values (normal with
the config's `initializer_range`, norms one), and each decoder layer is quantised at once when the teacher loads
in 4-bit, as the loader quantises (`quantise_in_place`: NF4 `Linear4bit` layers, no double quantisation, and the
loader's `quantise_fused_experts`), so no more than one layer is ever in 16 bits. Tied embeddings stay tied; the
lm_head computes float32 logits where `teacher.lm_head_float32` says so. A MoE's router is random too: its
tokens spread over the experts more evenly than a trained router's, which the speed may feel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kdflow.tasks.common.fused_experts import quantise_fused_experts
from kdflow.tasks.common.models import text_config


def quantise_in_place(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """The loader's 4-bit applied to a model already in memory: each nn.Linear but the output layer replaced by a
    bitsandbytes `Linear4bit` (NF4, no double quantisation, computing in `compute_dtype`), then the fused experts
    quantised by the loader's `quantise_fused_experts`. Layers still on the meta device are left for their turn.
    -> how many Linear layers it replaced."""
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    heads = (head, getattr(head, "linear", None))  # the pass's float32-logits wrapper holds the Linear
    replaced = 0
    for name, module in list(model.named_modules()):
        if (not isinstance(module, nn.Linear) or module in heads or isinstance(module, bnb.nn.Linear4bit)
                or module.weight.device.type == "meta"):
            continue
        device = module.weight.device
        layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                  compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=False,
                                  device="meta")
        layer.weight = bnb.nn.Params4bit(module.weight.data.to("cpu" if device.type == "cpu" else device),
                                         requires_grad=False, quant_type="nf4",
                                         compress_statistics=False).to(device)
        if module.bias is not None:
            layer.bias = nn.Parameter(module.bias.data, requires_grad=False)
        layer.train(module.training)  # bitsandbytes' CPU kernels differ by mode (avx512_bf16: a packed one in eval)
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, layer)
        replaced += 1
    quantise_fused_experts(model, quant_type="nf4", double_quant=False)
    return replaced


def build_random_teacher(model_config: Any, device: torch.device | str, dtype: torch.dtype, *, four_bit: bool,
                         lm_head_float32: bool, seed: int = 0) -> nn.Module:
    """The model of `model_config` (a transformers config) on `device` with random `dtype` weights, in eval mode
    with gradients off; in 4-bit when `four_bit`, never more than one decoder layer in 16 bits."""
    from transformers import AutoModelForCausalLM

    from kdflow.tasks.common.teacher_loading import float32_lm_head

    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    text = text_config(model_config)
    std = float(getattr(text, "initializer_range", None) or 0.02)
    generator = torch.Generator(device=device).manual_seed(seed)

    def materialise(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=True)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, std, generator=generator)

    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if isinstance(layers, nn.ModuleList):
        for name, child in model.named_children():
            if child is not body:
                materialise(child)
        for name, child in body.named_children():
            if child is not layers:
                materialise(child)
        for layer in layers:
            materialise(layer)
            if four_bit:
                quantise_in_place(model, dtype)  # the layers still on the meta device are left for their turn
    else:  # another layout: built whole (a small model), then quantised
        materialise(model)
        if four_bit:
            quantise_in_place(model, dtype)
    _recompute_buffers(model, device)
    if getattr(text, "tie_word_embeddings", False):
        model.tie_weights()  # `to_empty` gave the head a tensor of its own
    model.eval().requires_grad_(False)
    if lm_head_float32:
        float32_lm_head(model)
    return model


def _recompute_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers computed in a module's constructor (rotary tables) hold garbage after `to_empty`: each such module
    is made again on the device from its config."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            if not hasattr(module, "config"):
                raise RuntimeError(f"random weights: cannot compute {name} ({type(module).__name__}) again on "
                                   f"{device}: it keeps no config")
            with torch.device(device):
                fresh = type(module)(config=module.config)
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attribute, fresh)
