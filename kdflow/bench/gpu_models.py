"""The GPU check's random reference teachers, made in the device's memory (never written: 61 GiB of bf16 would not
fit the lent machine's disk), both by the tasks layer's `random_teacher.build_random_teacher`: in bf16
(`build_random`, then quantised in place as the loader quantises by `random_teacher.quantise_in_place`), or in
4-bit layer by layer, never more than one decoder layer in 16 bits (`build_quantised`, for a device the bf16
teacher does not fit: the 24 GiB cap, a small card).
Used by the full-depth and capped steps (gpu_full_depth.py, gpu_capped.py) and the hub-layout writer's tests.
"""

from __future__ import annotations

from typing import Any

from kdflow.bench.gpu_plan import reference_config
from kdflow.tasks.common.random_teacher import build_random_teacher


def build_random(shapes: dict[str, int], layers: int, device: str, seed: int = 0) -> Any:
    """A Qwen3-MoE of these shapes and depth with random bf16 weights, made on `device` directly."""
    import torch

    return build_random_teacher(reference_config(shapes | {"num_hidden_layers": layers}), device, torch.bfloat16,
                                four_bit=False, lm_head_float32=False, seed=seed)


def build_quantised(shapes: dict[str, int], device: str, seed: int = 0) -> Any:
    """The random Qwen3-MoE of these shapes in 4-bit with a float32-logits head, never more than one decoder layer
    in 16 bits on `device` (the tasks layer's `build_random_teacher`, as `kdflow tune precompute --random-weights`
    builds a teacher)."""
    import torch

    return build_random_teacher(reference_config(shapes), device, torch.bfloat16, four_bit=True, lm_head_float32=True,
                                seed=seed)
