"""Loading the teacher as one whole model on one device, shared by the teacher pass (kdflow.tasks.teacher) and the
student's held-out evaluation (kdflow.tasks.student.heldout_teacher), which must not import each other.

The reference teacher (a 32B MoE in 4-bit on a 24 GB GPU) taught us that `device_map="auto"` may silently
offload layers to CPU or disk (9 MoE layers ran from disk in fp16, hours slower), so we place the whole model
on one device and treat anything left elsewhere as an error that names the modules.

In 4-bit, the experts of an MoE that transformers stores as fused 3-D parameters are quantised too, as they load
(`kdflow.tasks.common.fused_experts`): bitsandbytes alone would leave them, most of the reference teacher, in 16 bits.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
from torch import nn

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import KDFlowError
from kdflow.tasks.common.float32_logits import SIXTEEN_BIT, Float32Logits
from kdflow.tasks.common.fused_experts import quantise_fused_experts, quantising_fused_experts
from kdflow.tasks.common.model_files import check_teacher_files
from kdflow.tasks.common.models import output_layer, resolve_device, resolve_dtype


class TeacherPlacementError(KDFlowError):
    """Part of the teacher is not on the target device (offloaded to CPU/disk, or never loaded)."""


def source_kwargs(teacher: TeacherConfig) -> dict[str, Any]:
    """What `from_pretrained` needs to find the teacher's files: revision, GGUF file, remote code."""
    kwargs: dict[str, Any] = {"trust_remote_code": teacher.trust_remote_code}
    if teacher.revision:
        kwargs["revision"] = teacher.revision
    if teacher.gguf_file:
        kwargs["gguf_file"] = teacher.gguf_file
    return kwargs


def load_teacher(teacher: TeacherConfig, *, device: torch.device | str | None = None) -> nn.Module:
    """The teacher on one device, in eval mode with gradients off; raises if any part was placed elsewhere."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    local = check_teacher_files(teacher)
    target = resolve_device(str(device) if device is not None else teacher.device)
    dtype = resolve_dtype(teacher, target)
    kwargs = source_kwargs(teacher) | {"dtype": dtype, "device_map": {"": str(target)}}
    if local is not None and not teacher.gguf_file and any(n.endswith(".safetensors") for n in os.listdir(local)):
        # Prefer safetensors (hub ids prefer them by default); transformers reads .bin files only with
        # torch.load(weights_only=True), never unpickling arbitrary objects.
        kwargs["use_safetensors"] = True
    if not teacher.load_in_4bit:
        with no_gguf_bar() if teacher.gguf_file else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(local or teacher.model, **kwargs)
    else:
        quantisation = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        experts = {"quant_type": quantisation.bnb_4bit_quant_type,
                   "double_quant": quantisation.bnb_4bit_use_double_quant}
        with quantising_fused_experts(**experts):  # each as it is set: never all in 16 bits on the device
            model = AutoModelForCausalLM.from_pretrained(local or teacher.model, quantization_config=quantisation,
                                                         **kwargs)
        quantise_fused_experts(model, **experts)  # any the hook did not see (a transformers without it)
    model.eval()
    model.requires_grad_(False)
    check_placement(model, target)
    if teacher.lm_head_float32:
        float32_lm_head(model)
    return model


@contextlib.contextmanager
def no_gguf_bar() -> Iterator[None]:
    """transformers dequantises a GGUF under a tqdm bar of its own, which neither its logging settings nor kdflow's
    child processes govern: in a training run on a terminal it cut through the log lines. Off while it loads."""
    module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar = getattr(module, "tqdm", None)
    if bar is None:  # another transformers: nothing to quiet
        yield
        return
    module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        module.tqdm = bar


def float32_lm_head(model: nn.Module) -> bool:
    """`teacher.lm_head_float32`: a 16-bit `nn.Linear` lm_head wrapped so that its logits come out in float32,
    never rounded to 16 bits (`Float32Logits`: no copy of the weight; the chunked top-K, the sampler and the
    model's own forward all take that path). A float32 head already gives float32 logits, and a quantised one
    computes its own: both are left as they are. -> whether the head was wrapped."""
    head = output_layer(model)
    if isinstance(head, Float32Logits):
        return True
    if type(head) is not nn.Linear or head.weight.dtype not in SIXTEEN_BIT:
        return False
    model.set_output_embeddings(Float32Logits(head))
    return True


def misplaced_modules(model: nn.Module, target: torch.device) -> dict[str, str]:
    """Module name -> where its tensors are, for every module not wholly on `target` (meta is never fine)."""
    misplaced: dict[str, str] = {}
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        where = tensor.device
        wrong_type = where.type != target.type
        wrong_index = target.index is not None and where.index is not None and where.index != target.index
        if where.type == "meta" or wrong_type or wrong_index:
            misplaced.setdefault(name.rpartition(".")[0] or name, str(where))
    for module, where in (getattr(model, "hf_device_map", None) or {}).items():
        if str(where) == "disk" or (target.type != "cpu" and str(where) == "cpu"):
            misplaced.setdefault(module or "<whole model>", str(where))
    return misplaced


def check_placement(model: nn.Module, target: torch.device) -> None:
    misplaced = misplaced_modules(model, target)
    if misplaced:
        names = sorted(misplaced)
        listed = ", ".join(f"{n} ({misplaced[n]})" for n in names[:8])
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        raise TeacherPlacementError(
            f"teacher is not wholly on {target}: {len(names)} module(s) left elsewhere: {listed}{more} "
            "(not enough device memory? try teacher.load_in_4bit)"
        )
