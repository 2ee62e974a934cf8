"""`kdflow bench kernels`: every Triton kernel of the teacher pass compiled ahead of time for the GPUs kdflow runs on,
here, without a GPU: sm_90 (H100, H200), sm_86 (RTX 3090, the 24 GB reference), sm_80 (A100), with the Triton
installed here. One JSON line per (kernel, the dtypes it is launched with, GPU): the compile's seconds, the shared
memory it asks for against that GPU's limit per block (a kernel over the limit compiles but cannot launch), its
warps and stages, the tensor-core instructions in its PTX, its cubin's size, and its registers per thread and
spilled bytes (`ptxas -v`); or the first line of the compiler's error, and the command exits 1.

How: Triton compiles for any target it is given. A stand-in driver names the target (and a device per target, so
each has its own cache), and each kernel's own launcher runs on small CPU tensors of the dtypes the pass uses, with
Triton's launch replaced by its compile: the signature, the specialisations and the constants are exactly the ones
the launcher passes. Where a launcher picks the interpreter's path (`UPCAST`: the interpreter's 16-bit dot), the
GPU's is compiled. Nothing runs: the kernels' values are tested through the interpreter (tests/test_tiled_topk.py,
tests/test_sampled_tiles.py, tests/test_fused_moe.py) and timed on a GPU by `kdflow bench head` and `kdflow bench
body`. TRITON_INTERPRET must be unset (Triton decides when it decorates a kernel whether it is interpreted); the
GPU image's Triton is checked the same way with its wheel first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from kdflow.bench.harness import emit, note
from kdflow.schemas.errors import first_paragraph

# Shared memory a block may use (the opt-in maximum), bytes, by compute capability.
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
GPUS = {80: "A100", 86: "RTX 3090", 89: "L4/RTX 4090", 90: "H100/H200"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdflow bench kernels", description=first_paragraph(__doc__))
    parser.add_argument("--arch", default="90,86,80",
                        help=f"compute capabilities, a comma list of {','.join(map(str, SHARED_LIMIT))} "
                             "(default 90,86,80)")
    args = parser.parse_args(argv)
    try:
        archs = [int(part) for part in args.arch.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"kdflow bench kernels: --arch {args.arch!r}: give compute capabilities such as 90,86")
    unknown = [arch for arch in archs if arch not in SHARED_LIMIT]
    if unknown or not archs:
        raise SystemExit(f"kdflow bench kernels: --arch {args.arch!r}: known are {','.join(map(str, SHARED_LIMIT))}")
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise SystemExit("kdflow bench kernels: needs Triton (pip install triton)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kdflow bench kernels: unset TRITON_INTERPRET (its kernels are interpreted, not compiled)")
    failed = False
    for record in records(archs):
        emit(record)
        failed |= "error" in record or record.get("fits_shared") is False
    return 1 if failed else 0


def records(archs: list[int]) -> Iterator[dict[str, Any]]:
    import triton

    note({"bench": "kernels", "triton": triton.__version__, "archs": archs})
    for arch in archs:
        for case, launch in cases(arch):
            with compile_only(arch) as compiled:
                try:
                    launch()
                except Exception as error:  # noqa: BLE001 - a kernel that does not compile is this line's result
                    text = (str(error).strip().splitlines() or [""])
                    message = next((line for line in text if "error" in line.lower()), text[0])
                    yield {"bench": "kernels", "arch": arch, "case": case, "triton": triton.__version__,
                           "error": f"{type(error).__name__}: {message}"[:400]}
                    continue
            for name, kernel, seconds in compiled:
                shared = int(kernel.metadata.shared)
                yield {"bench": "kernels", "arch": arch, "gpu": GPUS[arch], "case": case, "kernel": name,
                       "triton": triton.__version__, "compile_s": round(seconds, 2), "shared_bytes": shared,
                       "shared_limit": SHARED_LIMIT[arch], "fits_shared": shared <= SHARED_LIMIT[arch],
                       "num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages,
                       "tensor_cores": tensor_core_instructions(kernel.asm.get("ptx", "")),
                       "cubin_bytes": len(kernel.asm.get("cubin", b"")), **ptxas_report(kernel.asm.get("ptx", ""))}


def ptxas_report(ptx: str) -> dict[str, int | None]:
    """Registers per thread and spilled bytes of a kernel, from `ptxas -v` on its PTX (the first of Triton's bundled
    assemblers that takes the PTX's version; on PATH otherwise); None where none does."""
    import re
    import shutil
    import subprocess
    import tempfile

    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tools = [os.path.join(bundled, name) for name in ("ptxas", "ptxas-blackwell")] + [shutil.which("ptxas") or ""]
    target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
    found: dict[str, int | None] = {"registers": None, "spill_stores": None, "spill_loads": None}
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w", encoding="utf-8") as handle:
            handle.write(ptx)
        for tool in (tool for tool in tools if target and os.access(tool, os.X_OK)):
            result = subprocess.run([tool, f"-arch={target[1]}", "-v", source, "-o", os.path.join(folder, "k.cubin")],
                                    capture_output=True, text=True, timeout=300)
            registers = re.search(r"Used (\d+) registers", result.stderr)
            if result.returncode == 0 and registers:
                spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
                found["registers"] = int(registers[1])
                if spills:
                    found["spill_stores"], found["spill_loads"] = int(spills[1]), int(spills[2])
                break
    return found


def tensor_core_instructions(ptx: str) -> str | None:
    """Which tensor-core instructions a kernel's PTX issues: `wgmma` (Hopper's warp-group MMA), `mma` (the
    warp-level MMA of Ampere on), or None."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma" if "mma.sync" in ptx else None


class _TargetOnly:
    """A Triton driver that only names a target: what JITFunction asks before it compiles. Nothing launches."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.arch, self.target = arch, GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return self.arch  # a device per target: JITFunction keeps a compile cache per device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list[tuple[str, Any, float]]]:
    """Within: Triton compiles for `arch` instead of launching, and the launchers take CPU tensors for CUDA ones.
    Yields the list that each compile appends (kernel name, compiled kernel, seconds) to."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from kdflow.tasks.teacher import tile_stats_kernel

    compiled: list[tuple[str, Any, float]] = []
    launch = JITFunction.run

    def compile_instead(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if "UPCAST" in kwargs:
            kwargs["UPCAST"] = False  # the GPU's path, not the interpreter's
        started = time.perf_counter()
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((getattr(self, "__name__", None) or self.fn.__name__, kernel, time.perf_counter() - started))
        return kernel

    saved = tile_stats_kernel.interpreting
    active = driver._active  # noqa: SLF001 - None where there is no GPU: reset_active() would look for one
    driver.set_active(_TargetOnly(arch))
    JITFunction.run = compile_instead
    tile_stats_kernel.interpreting = lambda: True  # every launcher's device check (check_triton_device) passes
    try:
        yield compiled
    finally:
        JITFunction.run = launch
        tile_stats_kernel.interpreting = saved
        driver._active = active  # noqa: SLF001


def cases(arch: int) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(what is compiled, a call of its launcher) for each kernel and dtype the pass launches it with on `arch`."""
    import torch

    from kdflow.tasks.teacher.sample_tile_kernel import sample_tile_stats_triton, tile_keys_triton
    from kdflow.tasks.teacher.tile_stats_kernel import tile_stats_triton

    rows, vocab, tile = 4, 1000, 128
    words = torch.zeros(rows, dtype=torch.int32)
    picked = torch.zeros((rows, 2), dtype=torch.int64)
    for dtype in (torch.float32, torch.bfloat16):  # the pass's float32 logits; a 16-bit head's own
        logits = torch.zeros((rows, vocab), dtype=dtype)
        label = str(dtype).removeprefix("torch.")
        yield f"tile_stats {label}", lambda logits=logits: tile_stats_triton(logits, tile)
        for scheme in ("priority", "gumbel"):
            yield (f"sampler {scheme} {label}",
                   lambda logits=logits, scheme=scheme: (sample_tile_stats_triton(logits, words, scheme, tile),
                                                         tile_keys_triton(logits, words, picked, scheme, tile)))
    yield from _head_gemm_cases()
    yield from _expert_cases(arch)


def _head_gemm_cases() -> Iterator[tuple[str, Callable[[], Any]]]:
    """The tiled-gemm head's GEMM for a 16-bit head with float32 logits (the pass's default) or its own, and for a
    float32 head; with the sampler's keys for the default; a hidden size of 64 is whole K steps of every tiling, as
    the reference's 2,560 is."""
    import torch

    from kdflow.tasks.teacher.head_gemm import head_gemm_sample_stats, head_gemm_stats

    rows, vocab, width = 4, 1000, 64
    for weights, logits in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                            (torch.float32, torch.float32)):
        label = f"{str(weights).removeprefix('torch.')} -> {str(logits).removeprefix('torch.')}"
        yield (f"head_gemm {label}",
               lambda weights=weights, logits=logits: head_gemm_stats(
                   torch.zeros((rows, width), dtype=weights), torch.zeros((vocab, width), dtype=weights),
                   torch.empty((rows, vocab), dtype=logits)))
    yield ("head_gemm sampler gumbel bfloat16 -> float32",
           lambda: head_gemm_sample_stats(torch.zeros((rows, width), dtype=torch.bfloat16),
                                          torch.zeros((vocab, width), dtype=torch.bfloat16),
                                          torch.empty((rows, vocab)), torch.zeros(rows, dtype=torch.int32), "gumbel"))


def _expert_cases(arch: int) -> Iterator[tuple[str, Callable[[], Any]]]:
    """The fused experts in each tiling `arch` runs them with (few slots an expert, then a prefill's)."""
    import importlib.util

    import torch

    from kdflow.tasks.teacher.fused_moe import FLOAT32, HOPPER, LARGE, SMALL, tiles_for

    four_bit = [False, True] if importlib.util.find_spec("bitsandbytes") is not None else [False]
    names = {SMALL: "small", LARGE: "large", HOPPER: "hopper", FLOAT32: "large"}
    for dtype, nf4 in [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
                       (torch.bfloat16, True)]:
        if nf4 not in four_bit:
            continue
        seen = set()
        for tokens in (8, 2 * LARGE.block_m, 2 * HOPPER.block_m):  # 2 slots a token over 4 experts
            tiles = tiles_for(2 * tokens, 4, arch, dtype == torch.float32)
            if tiles not in seen:
                seen.add(tiles)
                label = ("nf4 " if nf4 else "") + str(dtype).removeprefix("torch.")
                yield (f"experts {label} {names[tiles]}",
                       lambda dtype=dtype, nf4=nf4, tokens=tokens: _run_experts(dtype, nf4, tokens))


def _run_experts(dtype: Any, four_bit: bool, tokens: int) -> Any:
    """The fused experts' forward on a small Qwen3-MoE experts module (as a 4-bit teacher loads it, if asked) with
    `tokens` tokens choosing 2 of its 4 experts (the tiling follows from the slots per expert)."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from kdflow.tasks.common.fused_experts import quantise_fused_experts
    from kdflow.tasks.teacher.fused_moe import fused_experts_forward

    experts, hidden, inter = 4, 64, 64
    module = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                            num_experts_per_tok=2)).to(dtype)
    if four_bit:
        holder = torch.nn.Module()
        holder.config = Qwen3MoeConfig(num_experts=experts)
        holder.experts = module
        quantise_fused_experts(holder)
    chosen = torch.arange(tokens * 2).remainder(experts).view(tokens, 2)
    with torch.no_grad():
        return fused_experts_forward(module, torch.zeros((tokens, hidden), dtype=dtype), chosen,
                                     torch.full((tokens, 2), 0.5, dtype=dtype))
