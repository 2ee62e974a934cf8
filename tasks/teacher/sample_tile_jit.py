"""The jitted Triton kernels of the tiled sampler; their wrappers and contract: `sample_tile_kernel`. Imported only
when a kernel is first used (it imports Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from kdflow.tasks.teacher.sampling_noise import MIX32, TOKEN_DOMAIN32, UNIFORM_BITS

MIX_1 = tl.constexpr(MIX32[0])
MIX_2 = tl.constexpr(MIX32[1])  # above 2**31: a uint32 constant, so the product stays 32-bit unsigned
TOKEN_DOMAIN = tl.constexpr(TOKEN_DOMAIN32)
SHIFT = tl.constexpr(32 - UNIFORM_BITS)
SCALE = tl.constexpr(2.0**-UNIFORM_BITS)


@triton.jit
def mix32(z):  # z: uint32; multiplications wrap modulo 2**32
    z = z ^ (z >> 16)
    z = z * MIX_1
    z = z ^ (z >> 15)
    z = z * MIX_2
    return z ^ (z >> 16)


@triton.jit
def keys_of(values, word, columns, SCHEME: tl.constexpr):  # (.., TILE) float32 logits -> float32 keys
    token = mix32(columns.to(tl.uint32) ^ TOKEN_DOMAIN)
    bits = mix32(token ^ word)
    uniform = ((bits >> SHIFT).to(tl.float32) + 0.5) * SCALE
    noise = -tl.log(uniform)
    if SCHEME == 1:
        noise = -tl.log(noise)
    return values + noise


@triton.jit
def sample_tile_stats(logits_ptr, words_ptr, max_ptr, sum_ptr, key_ptr, vocab, tiles, row_stride,
                      SCHEME: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0)
    tile_ids = tl.program_id(1) * GROUP + tl.arange(0, GROUP)  # (GROUP,)
    columns = tile_ids[:, None] * TILE + tl.arange(0, TILE)[None, :]  # (GROUP, TILE)
    inside = columns < vocab
    values = tl.load(logits_ptr + row.to(tl.int64) * row_stride + columns, mask=inside,
                     other=float("-inf")).to(tl.float32)
    word = tl.load(words_ptr + row).to(tl.uint32, bitcast=True)
    top = tl.max(values, axis=1)  # (GROUP,)
    shift_by = tl.where(top == float("-inf"), 0.0, top)  # a tile of -inf only sums to 0, not NaN
    total = tl.sum(tl.exp(values - shift_by[:, None]), axis=1)
    keys = tl.where(inside, keys_of(values, word, columns, SCHEME), float("-inf"))
    keep = tile_ids < tiles
    out = row.to(tl.int64) * tiles + tile_ids
    tl.store(max_ptr + out, top, mask=keep)
    tl.store(sum_ptr + out, total, mask=keep)
    tl.store(key_ptr + out, tl.max(keys, axis=1), mask=keep)


@triton.jit
def tile_keys(logits_ptr, words_ptr, picked_ptr, keys_ptr, vocab, count, row_stride,
              SCHEME: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.program_id(1)
    tile_id = tl.load(picked_ptr + row.to(tl.int64) * count + slot)
    columns = tile_id * TILE + tl.arange(0, TILE)
    inside = columns < vocab
    values = tl.load(logits_ptr + row.to(tl.int64) * row_stride + columns, mask=inside,
                     other=float("-inf")).to(tl.float32)
    word = tl.load(words_ptr + row).to(tl.uint32, bitcast=True)
    result = tl.where(inside, keys_of(values, word, columns, SCHEME), float("-inf"))
    tl.store(keys_ptr + (row.to(tl.int64) * count + slot) * TILE + tl.arange(0, TILE), result)
