"""A MoE layer's experts in two Triton kernels: `precompute.experts: kdflow_fused` (issue 44, item 4).

transformers' `grouped_mm` experts gather a permuted copy of the hidden states, run the gate/up projection, the
activation and the product as separate kernels over the (tokens x k) rows, then the down projection, the routing
weights and the sum back. Here, after sorting the (token, expert) slots by expert (torch: a sort and a count over
tokens x k small integers):

- `expert_gate_up` reads each slot's token straight from the hidden states (no permuted copy) and writes
  silu(x W_gate^T) * (x W_up^T) with the activation and the product fused after its two GEMMs;
- `expert_down` multiplies that by W_down^T, scales each row by its routing weight and writes it to the slot's
  place in token order, so the unpermute is the sum of each token's k rows. As in transformers' own experts, the
  rows are in the layer's dtype and their sum accumulates in float32 (torch's sum of bf16): at the reference
  micro-batch (28,672 tokens x 8 slots x 2,560) float32 rows would be a 2.3 GB transient a layer, bf16 1.2 GB.

Blocks of `block_m` slots never straddle two experts (each expert's slots are padded up to a whole block by
masking), so each block reads one expert's weights. The tiling (`tiles_for`) follows the slots an expert and the
GPU: `SMALL` where an expert has few slots (short rows, the tests); for a prefill (~1,800 slots an expert at the
reference micro-batch) `LARGE`, 64-row blocks whose K step of 32 keeps a 4-bit teacher's kernels within an RTX
3090's shared memory without spilling registers, or on Hopper `HOPPER`, 128-row blocks and a K step of 64 for its
warp-group MMA (wgmma), each weight tile dequantised once for twice the rows (`kdflow bench kernels`: 85 KiB of an
H100's 227, 127 registers, no spills). Which tiling is fastest is the GPU's to say: `kdflow bench body
--moe-tiles` times others (`moe_tiling`), and the GPU check times `LARGE` and two more on Hopper beside it.
A 4-bit teacher's experts (`kdflow.tasks.common.fused_experts`)
are read as their packed NF4 values, dequantised where each tile is loaded: the other implementations dequantise a
whole layer's experts first (1.8 GiB at the reference shapes, every layer, every forward). Tested through Triton's
interpreter (TRITON_INTERPRET=1, CPU tensors) against the eager experts; a GPU times it (`kdflow bench body`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from kdflow.tasks.common.fused_experts import BLOCK as NF4_BLOCK, Dequantised
from kdflow.tasks.common.models import body_runner
from kdflow.tasks.teacher.gemm_tiles import GemmTiles, constant_under_compile, interpreted, target_arch
from kdflow.tasks.teacher.tile_stats_kernel import check_triton_device

__all__ = ["FLOAT32", "FUSED_EXPERTS", "HOPPER", "LARGE", "SMALL", "block_schedule", "default_tiles",
           "fused_experts_forward", "moe_tiling", "register_fused_experts", "scale_aligned", "schedule_blocks",
           "teacher_body_runner", "tiles_for"]

FUSED_EXPERTS = "kdflow_fused"


SMALL = GemmTiles(16, 32, 32, num_stages=3, num_warps=4)  # few slots an expert: short rows, the tests
LARGE = GemmTiles(64, 64, 32, num_stages=3, num_warps=4)  # a prefill elsewhere: fits an RTX 3090's shared memory
HOPPER = GemmTiles(128, 64, 64, num_stages=3, num_warps=8)  # a prefill on sm_90: 128-row blocks, wgmma's K step
# A float32 layer's prefill (full float32 products, no tensor cores): with 4 warps it spilled on sm_90 (Triton 3.6).
FLOAT32 = GemmTiles(64, 64, 32, num_stages=3, num_warps=8)
_TILING: list[GemmTiles | None] = [None]  # moe_tiling's (a list, not a ContextVar: torch.compile reads it)


def tiles_for(slots: int, experts: int, arch: int | None = None, float32: bool = False) -> GemmTiles:
    """The kernels' tiling for `slots` (token, expert) slots over `experts` experts on compute capability `arch`
    (None: Triton's interpreter) for 16-bit or 4-bit layers (`float32`: float32 ones): the largest whose blocks the
    slots fill on average (Hopper's, then `LARGE`; `FLOAT32`), else `SMALL` (less padding)."""
    if float32:
        ladder: tuple[GemmTiles, ...] = (FLOAT32,)
    else:
        ladder = (HOPPER, LARGE) if arch is not None and arch >= 90 else (LARGE,)
    return next((tiles for tiles in ladder if slots >= tiles.block_m * experts), SMALL)


def default_tiles(slots: int, experts: int, device: torch.device, dtype: torch.dtype) -> GemmTiles:
    """`tiles_for` the GPU in use (or the interpreter) and the layer's dtype."""
    return tiles_for(slots, experts, None if interpreted(device) else target_arch(), dtype == torch.float32)


@contextmanager
def moe_tiling(tiles: GemmTiles | None) -> Iterator[None]:
    """Within: the fused experts run with `tiles` (None: `default_tiles`), how `kdflow bench body --moe-tiles`
    times other tilings than the device's."""
    before, _TILING[0] = _TILING[0], tiles
    try:
        yield
    finally:
        _TILING[0] = before


def scale_aligned(row: int, block_k: int) -> bool:
    """Whether a K step of `block_k` weights of rows `row` long always lies within one of NF4's 64-weight scale
    blocks (each row then reads its packed bytes once and one scale a step; the reference's rows, 2,560 and 960
    weights, are whole blocks)."""
    return row % NF4_BLOCK == 0 and NF4_BLOCK % block_k == 0


def schedule_blocks(slots: int, experts: int, block: int) -> int:
    """The kernels' programs along the slots: enough for any routing of `slots` slots over `experts` experts in
    blocks of `block` (an expert's slots fill whole blocks but its last one), fixed by the shapes alone."""
    return slots // block + min(experts, slots)


def block_schedule(expert_ids: Tensor, experts: int, block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The (token, expert) slots (S,) sorted by expert -> (slot order (S,) int32: the flat (token * k + j) index
    of each sorted slot; per program (`schedule_blocks` of them) int32: its block's expert, first slot and the end
    of its expert's slots). The blocks come in expert order; an expert's last block is partly masked, an expert
    without slots has none, and the programs after the last block are idle (first slot = end = S: no live row).

    Computed on the device without reading anything back (no bincount or repeat_interleave, whose sizes depend on
    the routing): no host sync a layer, and the kernels' grid is the same every call, so that CUDA graphs and
    torch.compile (`precompute.compile_body`) take the fused experts whole."""
    flat = expert_ids.reshape(-1)
    expert_sorted, order = torch.sort(flat, stable=True)
    edges = torch.searchsorted(expert_sorted, torch.arange(experts + 1, device=flat.device, dtype=flat.dtype))
    starts, ends = edges[:-1], edges[1:]  # (E,) each expert's sorted slots
    blocks = (ends - starts + block - 1) // block  # (E,)
    blocks_end = torch.cumsum(blocks, 0)  # (E,) the first block after each expert's
    program = torch.arange(schedule_blocks(flat.numel(), experts, block), device=flat.device)
    expert = torch.searchsorted(blocks_end, program, right=True)  # (G,) = E for an idle program
    live = expert < experts
    expert = expert.clamp(max=experts - 1)
    first = starts[expert] + (program - (blocks_end[expert] - blocks[expert])) * block
    end = torch.where(live, ends[expert], flat.numel())
    return (order.to(torch.int32), expert.to(torch.int32), torch.where(live, first, end).to(torch.int32),
            end.to(torch.int32))


@dataclass(frozen=True)
class ExpertWeight:
    """An experts weight as the kernels read it: its values (16-bit, or NF4 packed two a byte), the NF4 code table
    and per-64 scales (the values themselves again where it is not NF4: unused), and its logical shape."""

    values: Tensor
    code: Tensor
    absmax: Tensor
    shape: torch.Size
    nf4: bool

    @property
    def pointers(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.values, self.code, self.absmax


def expert_weight(module: nn.Module, name: str) -> ExpertWeight:
    """`module.<name>` for the kernels: a 4-bit teacher's packed NF4 values as they are (never the layer
    dequantised whole), where `kdflow.tasks.common.fused_experts` quantised them without nested statistics; else
    the weight itself (a 4-bit weight of another kind: dequantised for this call, as the other implementations)."""
    if parametrize.is_parametrized(module, name):
        parametrization = module.parametrizations[name]
        state = getattr(parametrization[0], "quant_state", None)
        if (isinstance(parametrization[0], Dequantised) and state is not None and state.quant_type == "nf4"
                and state.blocksize == NF4_BLOCK and not getattr(state, "nested", False)):
            packed = parametrization.original.reshape(-1)
            return ExpertWeight(packed, state.code.float().contiguous(), state.absmax.float().contiguous(),
                                parametrization[0].shape, True)
    weight = getattr(module, name).contiguous()
    return ExpertWeight(weight, weight, weight, weight.shape, False)


def fused_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                          top_k_weights: Tensor) -> Tensor:
    """An experts module's forward (transformers' experts interface): hidden (T, D), chosen experts (T, k) and
    their routing weights (T, k) -> (T, D), for experts stored as gate_up_proj (E, 2I, D) and down_proj (E, D, I)
    with a SiLU gate and no bias."""
    if (getattr(self, "has_bias", False) or getattr(self, "is_transposed", False)
            or not getattr(self, "is_concatenated", True) or not getattr(self, "has_gate", True)):
        raise NotImplementedError("the fused experts take concatenated gate/up weights (E, 2I, D) without bias")
    activation = getattr(getattr(self, "config", None), "hidden_act", "silu")
    if activation != "silu":
        raise NotImplementedError(f"the fused experts fuse SiLU, not {activation}")
    check_triton_device(hidden_states, "the fused experts run", ": set precompute.experts to grouped_mm or auto")
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    gate_up, down = expert_weight(self, "gate_up_proj"), expert_weight(self, "down_proj")
    experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    tiles = _TILING[0] or default_tiles(top_k_index.numel(), experts, hidden_states.device, hidden_states.dtype)
    slots, block_expert, block_start, block_end = block_schedule(top_k_index, experts, tiles.block_m)
    x = hidden_states.contiguous()
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((tokens * top_k, hidden), dtype=x.dtype, device=x.device)  # every (slot, column) written
    schedule = torch.stack([block_expert, block_start, block_end], 1).contiguous()  # (programs, 3)
    launch = _launch if x.device.type == "cuda" else _INTERPRETED[0]
    launch(x, gate_up, down, h, out, slots, top_k_weights.reshape(-1).contiguous(), schedule, tiles, top_k)
    return out.view(tokens, top_k, hidden).sum(1)  # (T, D), accumulated in float32


def _launch(x: Tensor, gate_up: ExpertWeight, down: ExpertWeight, h: Tensor, out: Tensor, slots: Tensor,
            weights: Tensor, schedule: Tensor, tiles: GemmTiles, top_k: int) -> None:
    """The two kernels over the schedule's programs (a number fixed by the shapes: `schedule_blocks`)."""
    import triton

    from kdflow.tasks.teacher import fused_moe_jit

    blocks, hidden, inter = schedule.shape[0], x.shape[1], h.shape[1]
    if not blocks:
        return
    shape = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
             "num_warps": tiles.num_warps, "num_stages": tiles.num_stages, "IEEE": x.dtype == torch.float32,
             "UPCAST": x.device.type != "cuda"}  # the interpreter: its dot of 16-bit floats is wrong
    # one program a (block, column tile), a block's tiles consecutive (fused_moe_jit.block_tile: its rows read once)
    fused_moe_jit.expert_gate_up[(blocks * triton.cdiv(inter, tiles.block_n),)](
        x, *gate_up.pointers, h, slots, schedule, hidden, inter, top_k, NF4=gate_up.nf4,
        ALIGNED=scale_aligned(hidden, tiles.block_k), **shape)
    fused_moe_jit.expert_down[(blocks * triton.cdiv(hidden, tiles.block_n),)](
        h, *down.pointers, out, slots, weights, schedule, hidden, inter, NF4=down.nf4,
        ALIGNED=scale_aligned(inter, tiles.block_k), **shape)


# `_launch` under Triton's interpreter (CPU tensors). There the kernels are Python that torch.compile cannot trace, so
# a compiled body runs them outside its graph: `teacher_body_runner` puts `torch.compiler.disable(_launch)` here before
# it compiles one (not at import: that imports torch._dynamo, ~1.8 s). On CUDA torch.compile takes them in as kernels.
_INTERPRETED: list[Callable[..., None]] = [_launch]


def register_fused_experts() -> bool:
    """Make `kdflow_fused` an experts implementation transformers can set; False where this transformers has no
    experts interface."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(FUSED_EXPERTS, fused_experts_forward)
    return True


def teacher_body_runner(model: nn.Module, compiled: bool = False, backend: str = "inductor") -> Callable[..., Tensor]:
    """`body_runner` (kdflow.tasks.common.models) of a teacher, whose body may hold kdflow's kernels (`kdflow_fused`
    experts): under torch.compile their target is marked constant first (`constant_under_compile`), and under Triton's
    interpreter their launch is kept out of the graph."""
    if compiled:
        constant_under_compile()
        _INTERPRETED[0] = torch.compiler.disable(_launch)
    return body_runner(model, compiled=compiled, backend=backend)
