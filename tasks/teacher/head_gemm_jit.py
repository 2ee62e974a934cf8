"""The jitted Triton kernel of the `tiled-gemm` head; its wrapper and contract: `head_gemm`. Imported only when the
kernel is first used (it imports Triton).

One program computes one (BLOCK_M rows, TILE ids) block of logits = hidden @ weight^T, accumulated in float32 over
the hidden size, writes it in the logits' dtype and, from the values as written, the tile's max and sum of
exp(logit - max) for each of its rows: the tile statistics `tiled_topk` would otherwise read the logits again for;
with SAMPLE also the tile's max key for the tiled sampler (`sample_tile_jit.keys_of`, the same arithmetic as the
sampler's own kernels, so that the keys it recomputes for the picked tiles agree bit for bit).
The grid's first axis runs over row blocks, so the programs that run together share one tile of the weight (read
from memory once) while the chunk's hidden states stay in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdflow.tasks.teacher.gemm_jit import dot
from kdflow.tasks.teacher.sample_tile_jit import keys_of


@triton.jit
def head_gemm_tile_stats(h_ptr, w_ptr, out_ptr, max_ptr, sum_ptr, words_ptr, key_ptr, rows, vocab, width, tiles,
                         h_stride, w_stride, out_stride,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, SAMPLE: tl.constexpr,
                         SCHEME: tl.constexpr):
    SUB: tl.constexpr = BLOCK_N // TILE  # the head's tiles in one output block
    row_block = tl.program_id(0)
    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) rows of hidden and logits
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) vocabulary ids
    offs_k = tl.arange(0, BLOCK_K)
    live_m = offs_m < rows
    live_n = offs_n < vocab
    h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * h_stride  # (BM, 1)
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * w_stride  # (1, BN): the weight read as (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            a = tl.load(h_rows + ks[None, :], mask=live_m[:, None], other=0.0)  # (BM, BK)
            b = tl.load(w_rows + ks[:, None], mask=live_n[None, :], other=0.0)  # (BK, BN)
        else:
            a = tl.load(h_rows + ks[None, :], mask=live_m[:, None] & (ks[None, :] < width), other=0.0)
            b = tl.load(w_rows + ks[:, None], mask=live_n[None, :] & (ks[:, None] < width), other=0.0)
        if UPCAST:  # Triton's interpreter multiplies 16-bit floats wrongly: it is given float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = dot(a, b, acc, IEEE)  # IEEE, float32 weights: full float32 products, not TF32's
    written = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :], written,
             mask=live_m[:, None] & live_n[None, :])
    values = tl.where(live_n[None, :], written.to(tl.float32), float("-inf"))  # the statistics of what was written
    values = tl.reshape(values, (BLOCK_M, SUB, TILE))  # each head tile of the block apart
    top = tl.max(values, axis=2)  # (BM, SUB)
    shift = tl.where(top == float("-inf"), 0.0, top)  # a tile of -inf only sums to 0, not NaN
    total = tl.sum(tl.exp(values - shift[:, :, None]), axis=2)
    tile_ids = tl.program_id(1) * SUB + tl.arange(0, SUB)  # (SUB,)
    stats = offs_m.to(tl.int64)[:, None] * tiles + tile_ids[None, :]  # (BM, SUB)
    keep = live_m[:, None] & (tile_ids[None, :] < tiles)
    tl.store(max_ptr + stats, top, mask=keep)
    tl.store(sum_ptr + stats, total, mask=keep)
    if SAMPLE:  # the tiled sampler's third number: the tile's max key (logit + the row's kdflow.2 noise)
        word = tl.load(words_ptr + offs_m, mask=live_m, other=0).to(tl.uint32, bitcast=True)  # (BM,)
        columns = tl.reshape(offs_n, (SUB, TILE))
        keys = tl.where(columns[None, :, :] < vocab, keys_of(values, word[:, None, None], columns[None, :, :], SCHEME),
                        float("-inf"))
        tl.store(key_ptr + stats, tl.max(keys, axis=2), mask=keep)
