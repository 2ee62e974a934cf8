"""The GPU check's random reference teachers, made in the device's memory (never written: 61 GiB of bf16 would not
fit the lent machine's disk): whole in bf16 (`build_random`), quantised in place as the loader quantises
(`quantise_in_place`), or in 4-bit layer by layer, never more than one decoder layer in 16 bits (`build_quantised`,
for a device the bf16 teacher does not fit: the 24 GiB cap, a small card). Used by the full-depth and capped steps
(gpu_full_depth.py, gpu_capped.py) and the hub-layout writer's tests.
"""

from __future__ import annotations

from typing import Any


def build_random(shapes: dict[str, int], layers: int, device: str, seed: int = 0) -> Any:
    """A Qwen3-MoE of these shapes and depth with random bf16 weights, made on `device` directly."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**(shapes | {"num_hidden_layers": layers}), intermediate_size=4 * shapes["hidden_size"],
                            tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=1)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def quantise_in_place(model: Any) -> int:
    """The loader's 4-bit, applied to a model already in memory: each nn.Linear but the output layer replaced by a
    bitsandbytes `Linear4bit` (NF4, no double quantisation, computing in bf16), then the fused experts quantised
    by the loader's `quantise_fused_experts`. How many Linear layers it replaced."""
    import bitsandbytes as bnb
    import torch
    from torch import nn

    from kdflow.tasks.common.fused_experts import quantise_fused_experts

    head = model.get_output_embeddings()
    heads = (head, getattr(head, "linear", None))  # the pass's float32-logits wrapper holds the Linear
    replaced = 0
    for name, module in list(model.named_modules()):
        if (not isinstance(module, nn.Linear) or module in heads or isinstance(module, bnb.nn.Linear4bit)
                or module.weight.device.type == "meta"):  # a layer not yet given memory (gpu_capped.py)
            continue
        device = module.weight.device
        layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=False,
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


def build_quantised(shapes: dict[str, int], device: str, seed: int = 0) -> Any:
    """The random Qwen3-MoE of these shapes in 4-bit, never more than one decoder layer in 16 bits on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from kdflow.tasks.common.teacher_loading import float32_lm_head

    config = Qwen3MoeConfig(**shapes, intermediate_size=4 * shapes["hidden_size"], tie_word_embeddings=False,
                            eos_token_id=0, bos_token_id=0, pad_token_id=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(seed)

    def materialise(module: Any) -> None:
        module.to_empty(device=device, recurse=True)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)

    layers = model.model.layers
    for name, child in model.named_children():
        if name != "model":
            materialise(child)
    for name, child in model.model.named_children():
        if name != "layers":
            materialise(child)
    with torch.device(device):  # its tables are computed in its constructor, not drawn: made again there
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    for layer in layers:
        materialise(layer)
        quantise_in_place(model)  # the layers still on the meta device are left for their turn
    float32_lm_head(model)
    return model.eval().requires_grad_(False)
