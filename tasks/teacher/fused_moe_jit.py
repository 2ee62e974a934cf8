"""The jitted Triton kernels of the fused MoE experts; their wrapper and contract: `fused_moe`. Imported only when a
kernel is first used (it imports Triton).

Both kernels take one block of `BLOCK_M` sorted (token, expert) slots of one expert and one tile of output columns:
`expert_gate_up` computes silu(x W_gate^T) * (x W_up^T) for the block's tokens, gathered by index from the hidden
states (no permuted copy); `expert_down` multiplies that by W_down^T, scales each row by its routing weight and
writes it to the slot's place in token order (the caller sums a token's k rows). With `NF4` the weights are a
4-bit teacher's packed values (two a byte, the high nibble first, as bitsandbytes packs them), read as
code[nibble] * absmax[index // 64] where the tile is loaded: no layer is ever dequantised whole.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_weight(w_ptr, code_ptr, absmax_ptr, flat, mask, dtype: tl.constexpr, NF4: tl.constexpr,
                UPCAST: tl.constexpr):
    """A tile of weights at flat indices `flat` (int64), as `dtype` (float32 with UPCAST): read as they are, or
    from NF4 packed values (rounded to `dtype` as bitsandbytes rounds them when it dequantises)."""
    if NF4:
        byte = tl.load(w_ptr + flat // 2, mask=mask, other=0).to(tl.int32)
        nibble = tl.where(flat % 2 == 0, byte >> 4, byte & 15)
        value = tl.load(code_ptr + nibble, mask=mask, other=0.0) * tl.load(absmax_ptr + flat // 64, mask=mask,
                                                                          other=0.0)
        if UPCAST:  # the interpreter rounds float32 to 16 bits otherwise than the GPU: kept in float32 there
            return value
        return value.to(dtype)
    value = tl.load(w_ptr + flat, mask=mask, other=0.0)
    if UPCAST:
        return value.to(tl.float32)
    return value.to(dtype)


@triton.jit
def block_rows(schedule_ptr, BLOCK_M: tl.constexpr):
    """This program's block, from its (expert, first slot, end of the expert's slots) row of the schedule: its
    expert (int64), its sorted slots (BM,) and which of them are live."""
    entry = schedule_ptr + 3 * tl.program_id(0)
    rows = tl.load(entry + 1) + tl.arange(0, BLOCK_M)
    return tl.load(entry).to(tl.int64), rows, rows < tl.load(entry + 2)


@triton.jit
def expert_gate_up(x_ptr, w_ptr, code_ptr, absmax_ptr, h_ptr, slots_ptr, schedule_ptr, hidden, inter, top_k,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                   NF4: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) intermediate channels
    expert, rows, live = block_rows(schedule_ptr, BLOCK_M)  # (BM,) sorted slots
    tokens = (tl.load(slots_ptr + rows, mask=live, other=0) // top_k).to(tl.int64)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_expert = expert * (2 * inter) * hidden  # the expert's first weight, as a flat index
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * hidden + ks[None, :], mask=live[:, None] & (ks[None, :] < hidden),
                    other=0.0)  # (BM, BK)
        w_mask = (cols[:, None] < inter) & (ks[None, :] < hidden)
        w_gate = load_weight(w_ptr, code_ptr, absmax_ptr, w_expert + cols[:, None].to(tl.int64) * hidden + ks[None, :],
                             w_mask, x_ptr.dtype.element_ty, NF4, UPCAST)
        w_up = load_weight(w_ptr, code_ptr, absmax_ptr,
                           w_expert + (cols[:, None] + inter).to(tl.int64) * hidden + ks[None, :], w_mask,
                           x_ptr.dtype.element_ty, NF4, UPCAST)  # (BN, BK)
        if UPCAST:  # Triton's interpreter multiplies 16-bit floats wrongly: it is given float32
            x = x.to(tl.float32)
        gate += tl.dot(x, tl.trans(w_gate))
        up += tl.dot(x, tl.trans(w_up))
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, in float32
    tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], out.to(h_ptr.dtype.element_ty),
             mask=live[:, None] & (cols[None, :] < inter))


@triton.jit
def expert_down(h_ptr, w_ptr, code_ptr, absmax_ptr, out_ptr, slots_ptr, weights_ptr, schedule_ptr, hidden, inter,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                NF4: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) hidden channels
    expert, rows, live = block_rows(schedule_ptr, BLOCK_M)
    slots = tl.load(slots_ptr + rows, mask=live, other=0).to(tl.int64)  # the (token, k) each row answers
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_expert = expert * hidden * inter
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * inter + ks[None, :],
                    mask=live[:, None] & (ks[None, :] < inter), other=0.0)  # (BM, BK)
        w = load_weight(w_ptr, code_ptr, absmax_ptr, w_expert + cols[:, None].to(tl.int64) * inter + ks[None, :],
                        (cols[:, None] < hidden) & (ks[None, :] < inter), h_ptr.dtype.element_ty, NF4,
                        UPCAST)  # (BN, BK)
        if UPCAST:
            h = h.to(tl.float32)
        acc += tl.dot(h, tl.trans(w))
    scale = tl.load(weights_ptr + slots, mask=live, other=0.0).to(tl.float32)  # (BM,) routing weights
    tl.store(out_ptr + slots[:, None] * hidden + cols[None, :], acc * scale[:, None],
             mask=live[:, None] & (cols[None, :] < hidden))
