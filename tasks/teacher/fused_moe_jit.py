"""The jitted Triton kernels of the fused MoE experts; their wrapper and contract: `fused_moe`. Imported only when a
kernel is first used (it imports Triton).

Both kernels take one block of `BLOCK_M` sorted (token, expert) slots of one expert and one tile of output columns:
`expert_gate_up` computes silu(x W_gate^T) * (x W_up^T) for the block's tokens, gathered by index from the hidden
states (no permuted copy); `expert_down` multiplies that by W_down^T, scales each row by its routing weight and
writes it in the layer's dtype to the slot's place in token order (the caller sums a token's k rows). With `NF4`
the weights are a 4-bit teacher's packed values (two a byte, the high nibble first, as bitsandbytes packs them),
read as code[nibble] * absmax[index // 64] where the tile is loaded: no layer is ever dequantised whole. Where a
row is whole 64-weight scale blocks (the reference's are), a tile's bytes are read once, as (rows, K step / 2),
each split into its two nibbles, with one scale a row: compiled for sm_90, the 4-bit gate/up kernel's instructions
went from 1,937 to 1,072 and its shared memory from 86 to 35 KiB (the byte and scale gathers of each weight no
longer staged).

The programs run in a one-dimensional grid, a block's column tiles one after another (`block_tile`): the block's
rows, gathered from the hidden states, are read from memory once and from the L2 cache by its other column tiles,
and the weights of the expert a few consecutive blocks share stay there too. With the blocks one after another
for each column instead (a 2-D grid, blocks first), each column re-read every row from memory: at the reference
micro-batch ~1.2 GB of hidden-state rows per gate/up column tile (15 of them) and 0.44 GB per down column tile
(40), ~35 GB a layer against ~3.4 TFLOP of products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdflow.tasks.teacher.gemm_jit import dot


@triton.jit
def load_weight(w_ptr, code_ptr, absmax_ptr, starts, k0, k_len, live, dtype: tl.constexpr, NF4: tl.constexpr,
                UPCAST: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_K: tl.constexpr):
    """A (BN, BK) tile of weights: columns k0..k0+BK of the rows whose first weights are at flat indices `starts`
    (BN,) int64, rows of `k_len` weights, `live` (BN,) the rows that exist; as `dtype` (float32 with UPCAST). Read
    as they are, or from NF4 packed values (rounded to `dtype` as bitsandbytes rounds them when it dequantises).
    ALIGNED (rows of whole 64-weight scale blocks, BK dividing 64): each row's bytes are read once as (BN, BK/2)
    and split into their two nibbles, and one scale a row; otherwise each weight reads its byte and scale."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if NF4 and ALIGNED:
        pairs = tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_ptr + (starts[:, None] + k0) // 2 + pairs[None, :], mask=live[:, None],
                       other=0).to(tl.int32)  # (BN, BK/2)
        high = tl.load(code_ptr + (byte >> 4))
        low = tl.load(code_ptr + (byte & 15))
        scale = tl.load(absmax_ptr + (starts + k0) // 64, mask=live, other=0.0)  # (BN,): the row's one block
        value = tl.interleave(high, low) * scale[:, None]  # the high nibble is the first weight of a byte
    elif NF4:
        flat = starts[:, None] + ks[None, :]
        mask = live[:, None] & (ks[None, :] < k_len)
        byte = tl.load(w_ptr + flat // 2, mask=mask, other=0).to(tl.int32)
        nibble = tl.where(flat % 2 == 0, byte >> 4, byte & 15)
        value = tl.load(code_ptr + nibble, mask=mask, other=0.0) * tl.load(absmax_ptr + flat // 64, mask=mask,
                                                                          other=0.0)
    else:
        value = tl.load(w_ptr + starts[:, None] + ks[None, :], mask=live[:, None] & (ks[None, :] < k_len),
                        other=0.0)
    if UPCAST:  # the interpreter rounds float32 to 16 bits otherwise than the GPU, and multiplies 16-bit floats
        return value.to(tl.float32)  # wrongly: kept in float32 there
    return value.to(dtype)


@triton.jit
def block_tile(columns, BLOCK_N: tl.constexpr):
    """This program's (block, its output columns (BN,)): a block's `columns`-wide tiles are consecutive programs."""
    tiles = tl.cdiv(columns, BLOCK_N)
    program = tl.program_id(0)
    return program // tiles, (program % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def block_rows(schedule_ptr, block, BLOCK_M: tl.constexpr):
    """Block `block`, from its (expert, first slot, end of the expert's slots) row of the schedule: its expert
    (int64), its sorted slots (BM,), which of them are live, and whether it is idle (none is)."""
    entry = schedule_ptr + 3 * block
    first = tl.load(entry + 1)
    end = tl.load(entry + 2)
    rows = first + tl.arange(0, BLOCK_M)
    return tl.load(entry).to(tl.int64), rows, rows < end, first >= end


@triton.jit
def expert_gate_up(x_ptr, w_ptr, code_ptr, absmax_ptr, h_ptr, slots_ptr, schedule_ptr, hidden, inter, top_k,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                   NF4: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr):
    block, cols = block_tile(inter, BLOCK_N)  # cols (BN,): intermediate channels
    expert, rows, live, idle = block_rows(schedule_ptr, block, BLOCK_M)  # (BM,) sorted slots
    if idle:  # a program past the routing's last block (the grid is fixed by the shapes)
        return
    tokens = (tl.load(slots_ptr + rows, mask=live, other=0) // top_k).to(tl.int64)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate_rows = expert * (2 * inter) * hidden + cols.to(tl.int64) * hidden  # (BN,) each gate row's first weight
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * hidden + ks[None, :], mask=live[:, None] & (ks[None, :] < hidden),
                    other=0.0)  # (BM, BK)
        w_gate = load_weight(w_ptr, code_ptr, absmax_ptr, gate_rows, k0, hidden, cols < inter,
                             x_ptr.dtype.element_ty, NF4, UPCAST, ALIGNED, BLOCK_K)
        w_up = load_weight(w_ptr, code_ptr, absmax_ptr, gate_rows + inter * hidden, k0, hidden, cols < inter,
                           x_ptr.dtype.element_ty, NF4, UPCAST, ALIGNED, BLOCK_K)  # (BN, BK)
        if UPCAST:  # Triton's interpreter multiplies 16-bit floats wrongly: it is given float32
            x = x.to(tl.float32)
        gate = dot(x, tl.trans(w_gate), gate, IEEE)
        up = dot(x, tl.trans(w_up), up, IEEE)
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, in float32
    tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], out.to(h_ptr.dtype.element_ty),
             mask=live[:, None] & (cols[None, :] < inter))


@triton.jit
def expert_down(h_ptr, w_ptr, code_ptr, absmax_ptr, out_ptr, slots_ptr, weights_ptr, schedule_ptr, hidden, inter,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                NF4: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr):
    block, cols = block_tile(hidden, BLOCK_N)  # cols (BN,): hidden channels
    expert, rows, live, idle = block_rows(schedule_ptr, block, BLOCK_M)
    if idle:
        return
    slots = tl.load(slots_ptr + rows, mask=live, other=0).to(tl.int64)  # the (token, k) each row answers
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows_w = expert * hidden * inter + cols.to(tl.int64) * inter  # (BN,) each row's first weight
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * inter + ks[None, :],
                    mask=live[:, None] & (ks[None, :] < inter), other=0.0)  # (BM, BK)
        w = load_weight(w_ptr, code_ptr, absmax_ptr, rows_w, k0, inter, cols < hidden, h_ptr.dtype.element_ty, NF4,
                        UPCAST, ALIGNED, BLOCK_K)  # (BN, BK)
        if UPCAST:
            h = h.to(tl.float32)
        acc = dot(h, tl.trans(w), acc, IEEE)
    scale = tl.load(weights_ptr + slots, mask=live, other=0.0).to(tl.float32)  # (BM,) routing weights
    tl.store(out_ptr + slots[:, None] * hidden + cols[None, :], (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (cols[None, :] < hidden))
