"""The Triton kernel under `kdflow.tasks.teacher.tiled_topk`: per tile of ids, the max and the sum of
exp(logit - max), reading the logits once in their own dtype (bf16 logits are never upcast in memory).

One program takes one row and `group` tiles of `tile` ids as one (group, tile) block, reduced along the tile: wide
contiguous loads, two float32 numbers written per tile. The suite runs it through Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors) against `tile_stats_torch`; a GPU only times it. Importing this module needs
Triton; `triton_available()` asks without importing it.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (TRITON_INTERPRET=1: CPU tensors, the suite)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(tensor: Tensor, what: str, advice: str = "") -> None:
    """ValueError unless Triton can run a kernel on `tensor`: "{what} on CUDA tensors (or under ...), not cpu",
    then `advice` (": what to set instead") if given."""
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(f"{what} on CUDA tensors (or under TRITON_INTERPRET=1), not {tensor.device.type}{advice}")


def tile_stats_triton(logits: Tensor, tile: int, group: int = 16) -> tuple[Tensor, Tensor]:
    """The same as `tile_stats_torch`; `tile` and `group` powers of two (Triton's block shapes)."""
    import triton

    if tile & (tile - 1) or group & (group - 1):
        raise ValueError(f"tile and group must be powers of two, got {tile} and {group}")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be a (rows, vocab) tensor with contiguous rows")
    check_triton_device(logits, "the Triton tile kernel runs")
    interpret = interpreting()
    rows, vocab = logits.shape
    tiles = triton.cdiv(vocab, tile)
    tile_max = torch.empty((rows, tiles), dtype=torch.float32, device=logits.device)
    tile_sum = torch.empty((rows, tiles), dtype=torch.float32, device=logits.device)
    grid = (rows, triton.cdiv(tiles, group))
    _kernel(interpret)[grid](logits, tile_max, tile_sum, vocab, tiles, logits.stride(0), TILE=tile, GROUP=group)
    return tile_max, tile_sum


_COMPILED: dict[bool, object] = {}


def _kernel(interpret: bool):  # built on first use, so that importing kdflow never imports Triton
    if interpret not in _COMPILED:
        import triton
        import triton.language as tl

        @triton.jit
        def tile_stats(logits_ptr, max_ptr, sum_ptr, vocab, tiles, row_stride,
                       TILE: tl.constexpr, GROUP: tl.constexpr):
            row = tl.program_id(0)
            tile_ids = tl.program_id(1) * GROUP + tl.arange(0, GROUP)  # (GROUP,)
            columns = tile_ids[:, None] * TILE + tl.arange(0, TILE)[None, :]  # (GROUP, TILE)
            values = tl.load(logits_ptr + row.to(tl.int64) * row_stride + columns, mask=columns < vocab,
                             other=float("-inf")).to(tl.float32)
            top = tl.max(values, axis=1)  # (GROUP,)
            shift = tl.where(top == float("-inf"), 0.0, top)  # a tile of -inf only sums to 0, not NaN
            total = tl.sum(tl.exp(values - shift[:, None]), axis=1)
            keep = tile_ids < tiles
            tl.store(max_ptr + row.to(tl.int64) * tiles + tile_ids, top, mask=keep)
            tl.store(sum_ptr + row.to(tl.int64) * tiles + tile_ids, total, mask=keep)

        _COMPILED[interpret] = tile_stats  # decorated while the interpreter setting is what it is now
    return _COMPILED[interpret]
