"""4-bit for Mixture-of-Experts weights stored as fused 3-D parameters, as they load.

`BitsAndBytesConfig(load_in_4bit=True)` quantises by replacing `nn.Linear` layers. transformers 5 stores the experts
of Qwen3-MoE, Mixtral, OLMoE and their kin as one 3-D parameter per projection (experts x out x in), which is no
`nn.Linear`: bitsandbytes skips them and they load in 16 bits. For the reference teacher (a 32B MoE, 3B active)
that is ~56 GiB of experts instead of ~16, and the "4-bit" teacher does not fit a 24 GB GPU at all. transformers 4
kept one `nn.Linear` per expert, so the same checkpoint loaded in 4-bit there.

Here each such parameter is quantised to the teacher's NF4 (`bitsandbytes.functional.quantize_4bit`, the same
block size and statistics as the Linear layers) and read back through a parametrization that dequantises it once
per call of its module (torch's parametrization cache, open for that module's forward only: one layer's experts
in 16 bits at a time, ~1.8 GiB at the reference shapes). The blocks of 64 never straddle an expert
(each expert's matrix holds a multiple of 64 values), so the stored bytes are exactly those that per-expert
`Linear4bit` layers held under transformers 4: the same teacher, bit for bit.

It happens while transformers loads the checkpoint: with on-the-fly quantisation transformers loads one parameter
at a time (`core_model_loading.set_param_for_module`), and `quantising_fused_experts` quantises each expert
parameter as it is set, so the 16-bit experts never sit on the device together. A transformers without that
function loads them first and `quantise_fused_experts` catches up afterwards (enough where they fit in 16 bits).

Pure torch + bitsandbytes (+ the one transformers hook); no Prefect.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

# Where configs keep the number of routed experts (Qwen-MoE, Mixtral/OLMoE/GPT-OSS, DeepSeek, Ernie).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

_hook_lock = threading.Lock()


def expert_count(config: Any) -> int | None:
    """The number of routed experts the model's (text) config declares, or None for a dense model."""
    configs = [config]
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        configs.insert(0, get_text_config())
    for candidate in configs:
        for key in EXPERT_COUNT_KEYS:
            value = getattr(candidate, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return value
    return None


def is_fused_expert_weight(tensor: torch.Tensor, experts: int | None) -> bool:
    """A floating 3-D tensor whose first dimension is the expert count: one matrix per expert."""
    return (experts is not None and tensor.dim() == 3 and tensor.shape[0] == experts
            and tensor.is_floating_point() and tensor.device.type != "meta")


BLOCK = 64  # values per scale: bitsandbytes' Linear4bit default, so both hold the same bytes


class Dequantised(nn.Module):
    """A parametrization: the packed 4-bit values -> the weight in its own dtype and shape. bitsandbytes quantises
    the values in memory order whatever the shape; the packed tensor is kept as rows of one block because its CPU
    dequantiser (0.50.2) misreads rows that are not a multiple of a block (an expert's (64, 32) down projection
    came back wrong there; CUDA reads the values flat)."""

    def __init__(self, quant_state: Any, shape: torch.Size) -> None:
        super().__init__()
        self.quant_state = quant_state
        self.shape = shape

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(packed, self.quant_state).view(self.shape)


def _open_cache(module: nn.Module, inputs: Any) -> None:
    module._kdflow_dequantised = parametrize.cached()  # one dequantisation per forward, however often it is read
    module._kdflow_dequantised.__enter__()


def _close_cache(module: nn.Module, inputs: Any, output: Any) -> None:
    # getattr and an assignment, not `__dict__.pop`: torch 2.11's dynamo cannot trace the pop, which broke a compiled
    # 4-bit body's graph at every MoE layer (`precompute.compile_body`)
    cache = getattr(module, "_kdflow_dequantised", None)
    if cache is not None:
        module._kdflow_dequantised = None
        cache.__exit__(None, None, None)


def _quantise(module: nn.Module, name: str, quant_type: str, double_quant: bool) -> None:
    """Replace the weight `module.<name>` by its packed 4-bit values, read back through `Dequantised`."""
    from bitsandbytes.functional import quantize_4bit

    weight = getattr(module, name).data
    rows = weight.reshape(-1, BLOCK) if weight.numel() % BLOCK == 0 else weight.reshape(1, -1)
    packed, state = quantize_4bit(rows, blocksize=BLOCK, quant_type=quant_type, compress_statistics=double_quant)
    shape = weight.shape
    del weight, rows
    packed = nn.Parameter(packed, requires_grad=False)
    packed._is_hf_initialized = True  # loaded, not to be initialised by transformers after the load
    setattr(module, name, packed)  # the 16-bit weight is freed here
    parametrize.register_parametrization(module, name, Dequantised(state, shape), unsafe=True)
    if all(getattr(param, "_is_hf_initialized", False) for param in module.parameters()):
        # Every weight loaded (a packed one's `original` among them): transformers then skips the module when it
        # initialises what the checkpoint lacked, where it would read each weight through the parametrization
        # (the layer dequantised whole) and draw random values into that copy.
        module._is_hf_initialized = True
    if not getattr(module, "_kdflow_cache_hooks", False):
        module.register_forward_pre_hook(_open_cache)
        module.register_forward_hook(_close_cache, always_call=True)
        module._kdflow_cache_hooks = True


def _may_hold_fused_experts(module: nn.Module) -> bool:
    """Not a layer whose weight is 2-D by nature or another kind of 3-D (bitsandbytes' Linear4bit included)."""
    return not isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd))


def fused_expert_weights(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, module, attribute) of every fused expert weight still in floating point."""
    experts = expert_count(getattr(model, "config", None))
    found = []
    for module_name, module in model.named_modules():
        if not _may_hold_fused_experts(module):
            continue
        for name, param in module.named_parameters(recurse=False):
            if is_fused_expert_weight(param, experts):
                found.append((f"{module_name}.{name}" if module_name else name, module, name))
    return found


def quantise_fused_experts(model: nn.Module, *, quant_type: str = "nf4", double_quant: bool = False) -> int:
    """Quantise every fused expert weight of `model` still in floating point, in place; how many it quantised."""
    found = fused_expert_weights(model)
    for _, module, name in found:
        _quantise(module, name, quant_type, double_quant)
    return len(found)


@contextlib.contextmanager
def quantising_fused_experts(*, quant_type: str = "nf4", double_quant: bool = False) -> Iterator[list[str]]:
    """While transformers loads a model in this block, each fused expert weight is quantised as soon as it is set
    on its module. Yields the list of names quantised so (empty where this transformers has no such hook)."""
    quantised: list[str] = []
    try:
        from transformers import core_model_loading as loading
    except ImportError:  # transformers 4: experts are nn.Linear modules, which bitsandbytes quantises itself
        yield quantised
        return
    original = getattr(loading, "set_param_for_module", None)
    if original is None:
        yield quantised
        return

    def set_and_quantise(model: nn.Module, target_name: str, *args: Any, **kwargs: Any) -> Any:
        result = original(model, target_name, *args, **kwargs)
        module_path, _, name = target_name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        param = module._parameters.get(name)
        if (param is not None and _may_hold_fused_experts(module)
                and is_fused_expert_weight(param, expert_count(getattr(model, "config", None)))):
            _quantise(module, name, quant_type, double_quant)
            quantised.append(target_name)
        return result

    with _hook_lock:  # one loading at a time patches the module function
        loading.set_param_for_module = set_and_quantise
        try:
            yield quantised
        finally:
            loading.set_param_for_module = original


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights on their devices, by kind: "4bit" (the packed values of bitsandbytes' Linear4bit
    layers and of the experts quantised here, two a byte), "4bit_statistics" (their per-block scales), and every
    other parameter and buffer by dtype ("bfloat16", "float32", ...)."""
    seen: set[int] = set()
    out: dict[str, int] = {}

    def add(key: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            out[key] = out.get(key, 0) + tensor.numel() * tensor.element_size()

    def add_state(state: Any) -> None:
        while state is not None:  # double quantisation nests a state for the scales
            add("4bit_statistics", getattr(state, "absmax", None))
            add("4bit_statistics", getattr(state, "code", None))
            state = getattr(state, "state2", None)

    for module in model.modules():
        add_state(getattr(module, "quant_state", None))  # a parametrization of an expert weight
        for param in module.parameters(recurse=False):
            add_state(getattr(param, "quant_state", None))  # Linear4bit's Params4bit
    for tensor in [*model.parameters(), *model.buffers()]:
        add("4bit" if tensor.dtype == torch.uint8 else str(tensor.dtype).removeprefix("torch."), tensor)
    return out


def _expert_module(name: str, module: nn.Module) -> bool:
    """A module that holds routed experts, named by what transformers calls it (`mlp.experts`,
    `block_sparse_moe.experts`, `Qwen3MoeExperts`, ...) or lying inside one (transformers 4's per-expert layers)."""
    return "experts" in name.split(".") or type(module).__name__.endswith("Experts")


def experts_left_unquantised(model: nn.Module) -> list[str]:
    """Every floating-point parameter of 2 or 3 dimensions that an expert module of `model` holds: in a model
    loaded in 4-bit there should be none (the packed values are uint8). It reads what the model holds, by module
    name and dtype, without the expert count or the detector `quantise_fused_experts` works from, so a loader that
    forgot the experts, or a detector that missed them, shows here. A parametrized weight is judged by its
    stored `original` (a dequantised read-back is no weight held)."""
    left = []
    for module_name, module in model.named_modules():
        if not _expert_module(module_name, module):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() in (2, 3) and param.is_floating_point():
                left.append(f"{module_name}.{name}" if module_name else name)
    return left
