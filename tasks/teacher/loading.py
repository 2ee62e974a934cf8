"""Loading the teacher: whole-model placement and the checks that fail fast with one line.

The reference teacher (a 32B MoE in 4-bit on a 24 GB GPU) taught us two things. `device_map="auto"` may
silently offload layers to CPU or disk (9 MoE layers ran from disk in fp16, hours slower), so we place the
whole model on one device and treat anything left elsewhere as an error that names the modules. And the
cheap checks (paths, vocabulary, context length, tokenizer) run before the weights load, not after.
"""

from __future__ import annotations

import os
from itertools import chain
from typing import Any

import torch
from torch import nn

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.tasks.common.model_configs import teacher_limits_problem
from kdflow.tasks.common.models import check_teacher_source, resolve_device, resolve_dtype


class TeacherPlacementError(KDFlowError):
    """Part of the teacher is not on the target device (offloaded to CPU/disk, or never loaded)."""


def _source_kwargs(teacher: TeacherConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": teacher.trust_remote_code}
    if teacher.revision:
        kwargs["revision"] = teacher.revision
    if teacher.gguf_file:
        kwargs["gguf_file"] = teacher.gguf_file
    return kwargs


def load_teacher_config(teacher: TeacherConfig) -> Any:
    """The teacher's Hugging Face config, without its weights (for the checks that come first)."""
    from transformers import AutoConfig

    local = check_teacher_source(teacher)
    return AutoConfig.from_pretrained(local or teacher.model, **_source_kwargs(teacher))


def check_teacher_limits(model_config: Any, *, top_k: int, seq_len: int) -> None:
    """top_k within the vocabulary, seq_len within the context the teacher was trained for."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    problem = teacher_limits_problem(getattr(text_config, "vocab_size", None),
                                     getattr(text_config, "max_position_embeddings", None), top_k=top_k,
                                     seq_len=seq_len)
    if problem is not None:
        raise ConfigError(problem)


def load_teacher(teacher: TeacherConfig, *, device: torch.device | str | None = None) -> nn.Module:
    """The teacher on one device, in eval mode with gradients off; raises if any part was placed elsewhere."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    local = check_teacher_source(teacher)
    target = resolve_device(str(device) if device is not None else teacher.device)
    dtype = resolve_dtype(teacher, target)
    kwargs = _source_kwargs(teacher) | {"dtype": dtype, "device_map": {"": str(target)}}
    if local is not None and not teacher.gguf_file and any(n.endswith(".safetensors") for n in os.listdir(local)):
        # Prefer safetensors (hub ids prefer them by default); transformers reads .bin files only with
        # torch.load(weights_only=True), never unpickling arbitrary objects.
        kwargs["use_safetensors"] = True
    if teacher.load_in_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(local or teacher.model, **kwargs)
    model.eval()
    model.requires_grad_(False)
    check_placement(model, target)
    return model


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


def vocab_rows(model: nn.Module) -> int:
    """Rows of the teacher's input embedding: every token id fed to it must be below this."""
    return int(model.get_input_embeddings().num_embeddings)


def check_tokenizer_fits(tokenizer: Any, model: nn.Module) -> None:
    largest = max(max(tokenizer.get_vocab().values(), default=0), len(tokenizer) - 1)
    rows = vocab_rows(model)
    if largest >= rows:
        raise ConfigError(f"the tokenizer has ids up to {largest} but the teacher's embedding has only {rows} rows")
