"""How a Triton GEMM of the teacher pass is tiled (the tiled-gemm head's, the fused experts'), and the GPU it
compiles for: one tiling type, written and parsed as `BMxBNxBK:STAGES:WARPS`, so that a benchmark can time other
tilings than a kernel's default (`kdflow bench head --gemm-tiles`, `kdflow bench body --moe-tiles`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdflow.tasks.teacher.tile_stats_kernel import interpreting

__all__ = ["GemmTiles", "constant_under_compile", "interpreted", "parse_tilings", "target_arch"]


@dataclass(frozen=True)
class GemmTiles:
    """Rows and columns per program, the reduction step, Triton's pipeline stages and warps. Written
    `BMxBNxBK:STAGES:WARPS` (`parse`, `str`)."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}:{self.num_stages}:{self.num_warps}"

    @classmethod
    def parse(cls, text: str) -> GemmTiles:
        """"128x256x64:3:8" -> GemmTiles(128, 256, 64, 3, 8); ValueError naming the form otherwise."""
        try:
            shape, stages, warps = text.split(":")
            block_m, block_n, block_k = (int(part) for part in shape.split("x"))
            tiles = cls(block_m, block_n, block_k, int(stages), int(warps))
        except ValueError:
            raise ValueError(f"GEMM tiles {text!r}: write BMxBNxBK:STAGES:WARPS, such as 128x128x64:3:8") from None
        if any(n < 1 or n & (n - 1) for n in (block_m, block_n, block_k, tiles.num_warps)) or tiles.num_stages < 1:
            raise ValueError(f"GEMM tiles {text!r}: block sizes and warps must be powers of two, stages >= 1")
        return tiles


def parse_tilings(text: str) -> list[GemmTiles]:
    """A comma list of tilings ("" -> none)."""
    return [GemmTiles.parse(part) for part in text.split(",") if part.strip()]


def interpreted(device: torch.device) -> bool:
    """Whether Triton runs the kernels through its interpreter here (CPU tensors under TRITON_INTERPRET=1)."""
    return device.type != "cuda" and interpreting()


def target_arch() -> int:
    """The compute capability Triton compiles for (the GPU in use; `kdflow bench kernels`' stand-in target).
    torch.compile takes it as read, once, after `constant_under_compile` (a compiled body's fused experts call it)."""
    from triton.runtime import driver

    return int(driver.active.get_current_target().arch)


def constant_under_compile() -> None:
    """Mark `target_arch` as a constant for torch.compile (`torch.compiler.assume_constant_result`), so a compiled
    body holding kdflow's kernels does not trace Triton's driver. Called before each compile of a teacher body, never
    at import: the marker imports torch._dynamo, ~1.8 s of CPU for every process that imports the teacher modules
    without loading a model (loading one, transformers imports torch._dynamo itself)."""
    torch.compiler.assume_constant_result(target_arch)
