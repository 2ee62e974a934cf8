"""Jitted pieces the teacher pass's Triton GEMMs share (the `tiled-gemm` head's, `head_gemm_jit`, and the fused
experts', `fused_moe_jit`). Imported only with them (it imports Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; IEEE (float32 weights): full float32 products, not TF32's (Triton's default on a GPU)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
