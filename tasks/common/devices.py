"""Can this machine give a CUDA device? Told without importing torch, for pre-flight (kdflow.tasks.preflight): a
config that asks for `cuda` on a machine without one is refused before the corpus is read and tokenised, not by
the teacher's worker after them. Where torch is loaded (`resolve_device`, `rank_device`) it asks torch itself.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import sys


def cuda_unavailable() -> str | None:
    """Why no CUDA device can be had here ('torch 2.13.0+cpu is a CPU build', ...), or None when one may be."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None  # the stage says what is missing
    if "+cpu" in version:
        return f"torch {version} is a CPU build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    # NVIDIA's device files, WSL2's GPU bridge, ROCm's (whose torch also calls its GPUs cuda)
    if sys.platform.startswith("linux") and not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")
                                                 or os.path.exists("/dev/kfd")):
        return "this machine shows no GPU (no /dev/nvidia*)"
    return None


def no_cuda_message(setting: str, value: str, why: str) -> str:
    return f"{setting}={value!r}, but {why}: set it to auto (a GPU when there is one) or cpu"
