"""How the student computes, not what: its attention kernel, gradient checkpointing and torch.compile.

`student.attn_implementation`, `student.gradient_checkpointing` and `student.compile` compute the same function
up to float rounding, like the number of ranks does, so none of them is part of the training fingerprint: a run
may be resumed with one switched (kdflow.tasks.student.train.training_fingerprint).

- Attention: transformers' `set_attn_implementation` on the student (sdpa, eager, flash_attention_2). The
  choice is not written into the saved config.json: a saved student loads with transformers' default.
- Gradient checkpointing: transformers' own, non-reentrant (`torch.utils.checkpoint`, use_reentrant=False), one
  checkpoint per decoder layer: a layer keeps its input and recomputes its activations in backward. The fused
  loss reads the body's final hidden states, which are the last layer's output after the final norm, so it
  is unaffected. Non-reentrant checkpoints compose with DDP and FSDP2: under FSDP a layer is also the unit
  whose weights are gathered, and its recompute in backward happens while they are gathered anyway.
- Compile: `torch.compile` of each decoder layer in place (`Module.compile`, so parameter names and
  checkpoints do not change), before any data-parallel wrapping. Identical layers share one compiled graph,
  so the compile costs one layer's; FSDP's gathers and the checkpoint boundaries stay at layer edges, outside
  the compiled code. A student whose layers cannot be found (no `_no_split_modules`) compiles its whole body.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from kdflow.schemas.config import StudentConfig
from kdflow.schemas.errors import ConfigError, first_line
from kdflow.tasks.common.models import model_body
from kdflow.tasks.student.distributed import sharded_blocks

FLASH_ATTENTION = "flash_attention_2"


def check_student_options(student: StudentConfig, device: torch.device) -> None:
    """One-line errors for options this machine cannot run."""
    if student.attn_implementation != FLASH_ATTENTION:
        return
    key = f"student.attn_implementation={FLASH_ATTENTION}"
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(f"{key} needs the flash-attn package, which is not installed: pip install flash-attn "
                          "(CUDA only), or use sdpa")
    if device.type != "cuda":
        raise ConfigError(f"{key} needs a CUDA device, the student trains on {device}: use sdpa")
    if not (student.autocast_bf16 and torch.cuda.is_bf16_supported()):
        raise ConfigError(f"{key} runs in bfloat16: set student.autocast_bf16 true on a GPU that supports it, "
                          "or use sdpa")


def compile_units(student: nn.Module) -> list[nn.Module]:
    """The student's decoder layers (the classes transformers names in `_no_split_modules`), else its body."""
    return sharded_blocks(student) or [model_body(student)]


def apply_student_options(student: nn.Module, options: StudentConfig, device: torch.device) -> nn.Module:
    """Set the attention kernel, gradient checkpointing and compilation on `student` (in place; -> it).
    Call before any data-parallel wrapping."""
    check_student_options(options, device)
    try:
        student.set_attn_implementation(options.attn_implementation)
    except (ImportError, ValueError) as error:
        raise ConfigError(f"student.attn_implementation={options.attn_implementation}: {first_line(error)}") from None
    if options.gradient_checkpointing:
        if not getattr(student, "supports_gradient_checkpointing", False):
            raise ConfigError(f"student.gradient_checkpointing: {type(student).__name__} does not support it")
        # transformers >= 5.x names it activation_checkpointing_enable (the old name warns)
        enable = getattr(student, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if options.compile:
        for unit in compile_units(student):
            unit.compile()
    return student
