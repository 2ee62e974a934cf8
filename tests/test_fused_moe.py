"""The fused MoE experts (kdflow/tasks/teacher/fused_moe.py) through Triton's interpreter against transformers' eager
experts on fresh random inputs: the block schedule, the forward in float32 and bf16 (experts without tokens, experts
with several blocks), and the refusals."""

from __future__ import annotations

import random

import pytest
import torch

from kdflow.schemas.errors import ConfigError
from kdflow.tasks.teacher import fused_moe
from kdflow.tasks.teacher.fused_moe import (FLOAT32, HOPPER, LARGE, SMALL, block_schedule, fused_experts_forward,
                                            moe_tiling, schedule_blocks, tiles_for)
from kdflow.tasks.teacher.gemm_tiles import GemmTiles

pytestmark = pytest.mark.unit


def test_the_schedule_sorts_slots_by_expert_in_blocks_that_never_straddle_two() -> None:
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    experts, block = 7, 4
    chosen = torch.randint(0, experts - 1, (23, 3), generator=gen)  # the last expert gets no slot
    slots, block_expert, block_start, block_end = block_schedule(chosen, experts, block)
    flat = chosen.reshape(-1)
    assert block_expert.numel() == schedule_blocks(flat.numel(), experts, block) == 69 // 4 + 7  # whatever the routing
    assert sorted(slots.tolist()) == list(range(flat.numel())), seed  # every slot once
    assert flat[slots.long()].tolist() == sorted(flat.tolist()), seed  # in expert order
    covered, busy = [], []
    for expert, start, end in zip(block_expert.tolist(), block_start.tolist(), block_end.tolist(), strict=True):
        rows = range(start, min(start + block, end))
        assert all(int(flat[int(slots[r])]) == expert for r in rows), seed
        covered.extend(rows)
        busy.append(bool(rows))
    assert covered == list(range(flat.numel())), seed
    assert busy == sorted(busy, reverse=True), seed  # the idle programs last, each an empty block
    assert (experts - 1) not in block_expert[torch.tensor(busy)].tolist(), seed


def test_the_schedule_reads_nothing_back_so_a_compiled_graph_takes_it_whole() -> None:
    """No size depends on the routing (no host sync a layer): the schedule computes on fake tensors, shapes alone,
    to the programs `schedule_blocks` gives, as CUDA graphs and torch.compile need; compiled, it equals eager."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seed = random.randrange(1 << 30)
    chosen = torch.randint(0, 5, (19, 2), generator=torch.Generator().manual_seed(seed))
    with FakeTensorMode() as mode:
        shapes = [tuple(out.shape) for out in block_schedule(mode.from_tensor(chosen), 6, 4)]
    assert shapes == [(38,)] + [(schedule_blocks(38, 6, 4),)] * 3
    compiled = torch.compile(block_schedule, fullgraph=True, dynamic=False, backend="eager")
    for got, expected in zip(compiled(chosen, 6, 4), block_schedule(chosen, 6, 4), strict=True):
        assert torch.equal(got, expected), seed


def experts_module(dtype: torch.dtype, seed: int, hidden: int = 64, inter: int = 48, experts: int = 6):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=2)
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) / hidden**0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) / inter**0.5)
    return module.to(dtype)


def quantised(module: torch.nn.Module) -> int:
    """The experts module's weights quantised to NF4 in place, as a 4-bit teacher loads them: how many were."""
    from kdflow.tasks.common.fused_experts import quantise_fused_experts

    holder = torch.nn.Module()
    holder.config = type("Config", (), {"num_experts": module.gate_up_proj.shape[0]})()
    holder.experts = module
    return quantise_fused_experts(holder)


def nf4_values(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A 4-bit experts weight dequantised by bitsandbytes in float32 (code[nibble] * absmax), as the kernels read it
    under the interpreter (on a GPU they round it to the layer's dtype, as the other implementations do)."""
    import copy

    from bitsandbytes.functional import dequantize_4bit

    parametrization = module.parametrizations[name]
    state = copy.copy(parametrization[0].quant_state)
    state.dtype = torch.float32
    return dequantize_4bit(parametrization.original, state).view(parametrization[0].shape).float()


def assert_within_rounding(got: torch.Tensor, exact: torch.nn.Module, hidden: torch.Tensor, chosen: torch.Tensor,
                           weights: torch.Tensor, seed: int) -> None:
    """The fused kernels accumulate in float32 and round three times: each (token, expert) row's silu(gate) * up to
    the input's dtype, each row's w_k W_down h_k (as transformers' experts do), and the output, their float32 sum.
    Each output element is then within one unit roundoff u of the exact value (the float32 computation on the same
    weights, `exact`) times sum_k w_k |W_down| |h_k| (the first rounding, carried through the down projection) plus
    u sum_k |w_k W_down h_k| (the second) plus u |exact| (the third), and a float32 accumulation's slack. Triton's
    interpreter truncates float32 to 16 bits where a GPU rounds to nearest: the kernels' own two roundings may be
    off by 2u there (torch rounds the sum)."""
    unit = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[got.dtype]  # 2^-precision bits
    x, w = hidden.float(), weights.float()
    gate_up, down = exact.gate_up_proj.detach().float(), exact.down_proj.detach().float()  # (E, 2I, D), (E, D, I)
    inter = down.shape[2]
    carried = torch.zeros_like(x)
    rows = torch.zeros_like(x)
    for j in range(chosen.shape[1]):
        projected = torch.einsum("td,tnd->tn", x, gate_up[chosen[:, j]])  # (T, 2I)
        h = torch.nn.functional.silu(projected[:, :inter]) * projected[:, inter:]
        carried += w[:, j:j + 1] * torch.einsum("tdi,ti->td", down[chosen[:, j]].abs(), h.abs())
        rows += (w[:, j:j + 1] * torch.einsum("tdi,ti->td", down[chosen[:, j]], h)).abs()
    with torch.no_grad():
        reference = exact(x, chosen, w)
    bound = unit * (2 * (carried + rows) + reference.abs()) + 1e-5 * float(reference.abs().max())
    excess = (got.float() - reference).abs() - bound
    assert float(excess.max()) <= 0, (seed, float(excess.max()), float(bound.max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 3 * SMALL.block_m + 3, 3 * LARGE.block_m + 5])  # one slot per chosen
def test_the_fused_forward_computes_the_eager_experts(dtype: torch.dtype, tokens: int) -> None:  # .. many blocks
    """Through the small tiling and, from an average of a large block per expert, the large one."""
    pytest.importorskip("triton")
    prefill = FLOAT32 if dtype == torch.float32 else LARGE
    assert tiles_for(2 * tokens, 6, None, dtype == torch.float32) == (prefill if tokens > 3 * LARGE.block_m else SMALL)
    seed = random.randrange(1 << 30)
    module = experts_module(dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(tokens, 64, generator=gen).to(dtype)
    chosen = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(tokens)])  # expert 5 never chosen
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), 1).to(dtype)
    with torch.no_grad():
        expected = module(hidden, chosen, weights)
        got = fused_experts_forward(module, hidden, chosen, weights)
    assert got.dtype == dtype and got.shape == (tokens, 64)
    if dtype == torch.float32:
        assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max()), seed
    assert_within_rounding(got, experts_module(dtype, seed).float(), hidden, chosen, weights, seed)


def test_what_it_cannot_run_is_refused(tiny_moe_teacher_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.body_variants import measure_body_variants, use_experts

    module = experts_module(torch.float32, 0)
    module.config.hidden_act = "gelu"
    with pytest.raises(NotImplementedError, match="fuse SiLU, not gelu"):
        fused_experts_forward(module, torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter
    with pytest.raises(ValueError, match="run on CUDA tensors"):
        fused_experts_forward(experts_module(torch.float32, 0), torch.zeros(2, 64),
                              torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    model = load_teacher(TeacherConfig(model=str(tiny_moe_teacher_dir), device="cpu", dtype="float32"))
    with pytest.raises(ConfigError, match=r"^precompute.experts: kdflow_fused runs on CUDA, not cpu; set "):
        use_experts(model, "kdflow_fused")
    records = list(measure_body_variants(model, torch.zeros(1, 4, dtype=torch.long), ("eager", "kdflow_fused")))
    assert records[1] == {"variant": "kdflow_fused", "tokens": 4, "skipped": "kdflow_fused runs on CUDA, not cpu"}


def test_the_tiling_follows_the_slots_an_expert_and_the_gpu() -> None:
    """Hopper takes 128-row blocks from 128 slots an expert on average; every GPU 64-row blocks from 64; below,
    the small tiling; the interpreter never Hopper's (it is given one explicitly below); float32 layers (full
    float32 products, no tensor cores) their own, 8 warps."""
    experts = 128
    for arch, expected in ((90, [SMALL, LARGE, HOPPER]), (86, [SMALL, LARGE, LARGE]), (None, [SMALL, LARGE, LARGE])):
        assert [tiles_for(slots * experts, experts, arch) for slots in (63, 64, 1_800)] == expected
    assert tiles_for(127 * experts, experts, 90) == LARGE
    assert [tiles_for(slots * experts, experts, 90, float32=True) for slots in (63, 1_800)] == [SMALL, FLOAT32]


@pytest.mark.parametrize("tiling", [str(HOPPER), "128x128x64:3:8", "32x64x16:2:4"])
@pytest.mark.parametrize("four_bit", [False, True])
def test_any_tiling_computes_the_same_experts(tiling: str, four_bit: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiling given by `moe_tiling` (how a benchmark times others than the device's) gives the default's output up
    to float32 summation order, 4-bit rows (64 and 48 weights: both ways of reading them) included."""
    pytest.importorskip("triton")
    if four_bit:
        pytest.importorskip("bitsandbytes")
    seed = random.randrange(1 << 30)
    module = experts_module(torch.bfloat16, seed)
    if four_bit:
        assert quantised(module) == 2
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = 2 * HOPPER.block_m + 7
    hidden = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    chosen = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), 1).to(torch.bfloat16)
    with torch.no_grad():
        default = fused_experts_forward(module, hidden, chosen, weights).float()
        monkeypatch.setattr(fused_moe, "default_tiles", lambda *_: pytest.fail("the tiling given was not used"))
        with moe_tiling(GemmTiles.parse(tiling)):
            got = fused_experts_forward(module, hidden, chosen, weights).float()
    # bf16 outputs (and intermediates) whose float32 sums differ in order: a rounding step of 2^-8 may differ
    assert float((got - default).abs().max()) <= 2**-7 * float(default.abs().max()), (seed, tiling)


@pytest.mark.parametrize("inter", [48, 64])  # down_proj's rows: 48 weights read one by one, 64 by byte and block
@pytest.mark.parametrize("tokens", [9, 3 * LARGE.block_m + 5])  # the small tiling, the large one
def test_a_4bit_layers_experts_are_read_packed_and_never_dequantised_whole(monkeypatch: pytest.MonkeyPatch,
                                                                          tokens: int, inter: int) -> None:
    """NF4 values read where each tile is loaded are bitsandbytes' own dequantisation of them: the output is the
    float32 computation on those weights up to the kernels' roundings; no layer is dequantised whole. Rows of
    whole 64-weight scale blocks (gate_up_proj's 64 here) are read a byte pair and one scale at a time, others
    (48) weight by weight."""
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")
    from kdflow.tasks.common.fused_experts import Dequantised
    from kdflow.tasks.teacher.fused_moe import expert_weight, scale_aligned

    seed = random.randrange(1 << 30)
    module = experts_module(torch.bfloat16, seed, inter=inter)
    assert scale_aligned(64, LARGE.block_k) and scale_aligned(64, SMALL.block_k) and not scale_aligned(48, 32)
    assert quantised(module) == 2  # gate_up_proj and down_proj, as a 4-bit teacher loads them
    assert expert_weight(module, "gate_up_proj").nf4 and expert_weight(module, "down_proj").nf4
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    chosen = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), 1).to(torch.bfloat16)
    with torch.no_grad():
        exact = experts_module(torch.float32, seed, inter=inter)  # the NF4 values as the kernels read them, in float32
        for name in ("gate_up_proj", "down_proj"):
            getattr(exact, name).copy_(nf4_values(module, name))
        calls = []
        original = Dequantised.forward
        monkeypatch.setattr(Dequantised, "forward", lambda self, packed: calls.append(1) or original(self, packed))
        got = fused_experts_forward(module, hidden, chosen, weights)
    assert calls == []  # no weight dequantised whole
    assert_within_rounding(got, exact, hidden, chosen, weights, seed)
