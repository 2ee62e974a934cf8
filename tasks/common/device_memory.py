"""A CUDA process held to the memory of a smaller card: `kdflow tune precompute --memory-gib 24` on a big GPU tells
what a 24 GB card would fit, and the GPU check measures the 24 GB promise on an H100 or H200 the same way.

`torch.cuda.set_per_process_memory_fraction` caps the caching allocator. A real card of that size also holds the
CUDA context (~0.5 GiB, outside the allocator), so the allocator is held to the card's memory less the context
this process already holds.
"""

from __future__ import annotations

from typing import Any

import torch

from kdflow.tasks.common.units import GIB, MIB


def check_capped_device(setting: str, cap_gib: float, what: str = "--memory-gib") -> torch.device:
    """The device `teacher.device` names, when a cap of `cap_gib` can hold it; a one-line ConfigError naming the
    option (`what`) otherwise."""
    from kdflow.schemas.errors import ConfigError
    from kdflow.tasks.common.models import resolve_device

    if not cap_gib > 0:
        raise ConfigError(f"{what} must be a positive number of GiB, got {cap_gib:g}")
    device = resolve_device(setting)
    if device.type != "cuda":
        raise ConfigError(f"{what} holds a CUDA device to a smaller card's memory; teacher.device={setting!r} "
                          f"runs on {device}")
    return device


def cap_device_memory(device: torch.device | str, cap_gib: float) -> dict[str, Any]:
    """Hold this process's allocator on `device` to what a card of `cap_gib` would leave it. -> the cap's record
    (`cap_gib`, `context_gib`, `allocator_cap_gib`). `uncap_device_memory` lifts it."""
    where = torch.device(device)
    if where.type != "cuda":
        raise ValueError(f"a memory cap holds a CUDA device, not {where}")
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(where)
    context = max(0, total - free - torch.cuda.memory_reserved(where))  # the context (and any other process)
    allocator = max(0, int(cap_gib * GIB) - context)
    torch.cuda.set_per_process_memory_fraction(min(1.0, allocator / total), where)
    return {"cap_gib": cap_gib, "context_gib": round(context / GIB, 3), "allocator_cap_gib": round(allocator / GIB, 3)}


def uncap_device_memory(device: torch.device | str) -> None:
    torch.cuda.set_per_process_memory_fraction(1.0, torch.device(device))
    torch.cuda.empty_cache()


def capped_memory_record(record: dict[str, Any], cap: dict[str, Any]) -> dict[str, Any]:
    """A candidate's memory record (`tune_trial.memory_record`, CUDA) judged against the cap rather than the whole
    device: the card's total, and the headroom its allocator would have had at the peak."""
    allocator = cap["allocator_cap_gib"] * GIB
    headroom = allocator - record["peak_reserved_mib"] * MIB
    return record | {"total_mib": round(cap["cap_gib"] * GIB / MIB, 1), "headroom_mib": round(headroom / MIB, 1),
                     "headroom": round(headroom / (cap["cap_gib"] * GIB), 4), "memory_cap": cap}
