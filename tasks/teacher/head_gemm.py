"""The lm_head matmul with the tile statistics in its epilogue: `precompute.head: tiled-gemm` (issue 44, item 5).

The tiled head (`kdflow.tasks.teacher.tiled_topk`) has the matmul write a block's logits, then reads all of them
once more for each tile's max and sum of exp(logit - max) (`tile_stats`). Here one Triton GEMM does both: each of
its output blocks (rows x one or more tiles of `tile` ids, accumulated in float32) is written in the logits' dtype
and reduced to those two numbers per row and tile while it is still in registers. The logits are then read back only
in the K candidate tiles a row picks (1/12 of the row at the reference's K = 128, tile 128, 196,608 ids). At those
shapes that saves one read of the block's logits, 0.79 MB a token in float32 (~0.16 us at an H200's 4.8 TB/s),
against whatever the Triton GEMM loses to cuBLAS's: which is faster is measured (`kdflow bench head`, `kdflow tune
precompute`), not assumed.

For sampled and hybrid targets the same GEMM also writes each tile's max key (logit + kdflow.2 noise, by the
tiled sampler's own arithmetic, `head_gemm_sample_stats`): the three numbers `kdflow.tasks.teacher.sampled_tiles`
reads the logits for.

The statistics are those of the values as written (after rounding to bf16 logits, if that is the logits' dtype), so
that the tiles picked by their maxima hold the largest logits the candidates are read from. The suite runs the
kernel through Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) against the torch matmul and
`tile_stats_torch`; `kdflow bench kernels` compiles it for sm_90, sm_86 and sm_80; a GPU times it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdflow.tasks.teacher.gemm_tiles import GemmTiles, interpreted, target_arch
from kdflow.tasks.teacher.tile_stats_kernel import check_triton_device

__all__ = ["device_tiles", "gemm_tiles", "head_gemm_sample_stats", "head_gemm_stats"]


def gemm_tiles(arch: int | None, dtype: torch.dtype, tile: int = 128) -> GemmTiles:
    """The tiling for a compute capability (90: Hopper; 80-89: Ampere, Ada, the 24 GB reference card; None: Triton's
    interpreter, small blocks), the weight's dtype and the head's tile: 128 ids a program (or one tile, if wider).
    16-bit weights on Hopper take a K step of 64 (warp-group MMA); elsewhere 32, so that three stages fit an RTX
    3090's 99 KiB of shared memory; float32 weights take two stages. Which tiling is fastest is the GPU's to say
    (`kdflow bench head --gemm-tiles`)."""
    block_n = max(128, tile)
    if arch is None:
        return GemmTiles(16, block_n, 32, num_stages=1, num_warps=4)
    wide = dtype.itemsize == 4
    if arch >= 90 and not wide:
        return GemmTiles(128, block_n, 64, num_stages=3, num_warps=8)
    return GemmTiles(128, block_n, 32, num_stages=2 if wide else 3, num_warps=8)


def device_tiles(device: torch.device, dtype: torch.dtype, tile: int = 128) -> GemmTiles:
    """`gemm_tiles` for the GPU in use, or the interpreter's where Triton interprets (CPU tensors)."""
    return gemm_tiles(None if interpreted(device) else target_arch(), dtype, tile)


def head_gemm_stats(hidden: Tensor, weight: Tensor, out: Tensor, tile: int = 128,
                    tiling: GemmTiles | None = None) -> tuple[Tensor, Tensor]:
    """hidden (c, H) and weight (V, H) of one dtype -> `out` (c, V) = hidden @ weight^T in out's dtype (float32, or
    the weight's), and per tile of `tile` ids (c, n) float32: the max and the sum of exp(logit - max) of the logits
    as written (`tile_stats_torch`'s contract; the last tile's padding counts as -inf). `tiling`: the GEMM's tiling
    (default: `gemm_tiles` for the device)."""
    tile_max, tile_sum, _ = _launch(hidden, weight, out, tile, None, "priority", tiling)
    return tile_max, tile_sum


def head_gemm_sample_stats(hidden: Tensor, weight: Tensor, out: Tensor, words: Tensor, scheme: str,
                           tile: int = 128, tiling: GemmTiles | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`head_gemm_stats` and, third, each tile's max key under the rows' kdflow.2 stream words (c,) and `scheme`:
    `sample_tile_stats_torch`'s contract for the logits as written."""
    if words.shape != (hidden.shape[0],):
        raise ValueError(f"words must have one entry per row ({hidden.shape[0]}), got {tuple(words.shape)}")
    tile_max, tile_sum, key_max = _launch(hidden, weight, out, tile, words, scheme, tiling)
    return tile_max, tile_sum, key_max


def _launch(hidden: Tensor, weight: Tensor, out: Tensor, tile: int, words: Tensor | None, scheme: str,
            tiling: GemmTiles | None) -> tuple[Tensor, Tensor, Tensor]:
    import triton

    from kdflow.tasks.teacher import head_gemm_jit
    from kdflow.tasks.teacher.sample_tile_kernel import SCHEME_CODES

    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (c, H) and weight (V, H) do not match: {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must have one dtype, got {hidden.dtype} and {weight.dtype}")
    rows, width = hidden.shape
    vocab = weight.shape[0]
    if out.shape != (rows, vocab) or out.dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"out must be ({rows}, {vocab}) of float32 or {weight.dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    if hidden.stride(1) != 1 or weight.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("hidden, weight and out must have contiguous rows")
    check_triton_device(hidden, "the tiled-gemm head runs", ": set precompute.head to tiled or slab")
    tiling = tiling or device_tiles(hidden.device, weight.dtype, tile)
    if tiling.block_n % tile:
        raise ValueError(f"GEMM tiles {tiling}: {tiling.block_n} ids a program is not a whole number of tiles of "
                         f"{tile}")
    count = triton.cdiv(vocab, tile)
    sample = words is not None
    stats = [torch.empty((rows, count), dtype=torch.float32, device=hidden.device) for _ in range(3 if sample else 2)]
    if rows:
        grid = (triton.cdiv(rows, tiling.block_m), triton.cdiv(vocab, tiling.block_n))
        head_gemm_jit.head_gemm_tile_stats[grid](
            hidden, weight, out, stats[0], stats[1], words.contiguous() if sample else stats[0],
            stats[2] if sample else stats[0], rows, vocab, width, count,
            hidden.stride(0), weight.stride(0), out.stride(0), BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n,
            TILE=tile, BLOCK_K=tiling.block_k, EVEN_K=width % tiling.block_k == 0, UPCAST=hidden.device.type != "cuda",
            IEEE=weight.dtype == torch.float32, SAMPLE=sample, SCHEME=SCHEME_CODES[scheme],
            num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return stats[0], stats[1], stats[2] if sample else stats[0]
