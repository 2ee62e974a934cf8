"""How a MoE teacher's body runs, and its variants measured side by side (issue 44, item 4).

transformers 5 runs a MoE block's experts by one of several implementations (`experts_implementation`):
`grouped_mm` (the tokens sorted by expert, one grouped GEMM per projection; its default where torch has grouped
matmuls), `batched_mm` (each token's chosen experts' weights gathered and multiplied as a batch) and `eager` (a
loop over the experts); kdflow adds `kdflow_fused` (two Triton kernels with the activation fused, `fused_moe`;
CUDA). `precompute.experts` picks one for the pass (`auto`: transformers' choice) and `precompute.compile_body`
whether the body runs under torch.compile; each shard's commit record says which ran. A 4-bit teacher's experts
run the same way on the layer's dequantised weights (`kdflow.tasks.common.fused_experts`).

`measure_body_variants` times the body (embeddings to the final norm: the pass's forward without its head) under
each implementation and compiled (`compiled` with `grouped_mm` experts, `compiled_fused` with `kdflow_fused`: the
body under torch.compile at the micro-batch's fixed shape, as `compile_body` runs it; on CUDA with CUDA graphs,
`mode="reduce-overhead"`), each against `eager`'s hidden states. Pure torch; `kdflow bench body` and
the GPU check's `body_variants` step print its records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from kdflow.schemas.errors import ConfigError
from kdflow.tasks.common.fused_experts import expert_count
from kdflow.tasks.common.models import text_config
from kdflow.tasks.teacher.fused_moe import (FUSED_EXPERTS, default_tiles, moe_tiling, register_fused_experts,
                                            teacher_body_runner)
from kdflow.tasks.teacher.gemm_tiles import GemmTiles
from kdflow.tasks.teacher.tile_stats_kernel import interpreting, triton_available

__all__ = ["COMPILED", "EXPERTS", "EXPERTS_TOLERANCE", "VARIANTS", "experts_in_use", "fastest_correct",
           "measure_body_variants", "measure_pass_experts", "pass_settings", "use_experts"]

EXPERTS = ("grouped_mm", "batched_mm", "eager", FUSED_EXPERTS)
COMPILED = {"compiled": "grouped_mm", "compiled_fused": FUSED_EXPERTS}  # the compiled body with these experts
VARIANTS = (*EXPERTS, *COMPILED)
EXPERTS_TOLERANCE = 0.02  # the largest difference from eager's hidden states, relative to their largest, that counts
#                          as correct: bf16 rounding through a teacher's layers


def experts_in_use(model: nn.Module) -> str | None:
    """The experts implementation the model runs (None: not a MoE model)."""
    if expert_count(model.config) is None:
        return None
    config = text_config(model.config)
    return getattr(config, "_experts_implementation", None) or getattr(model.config, "_experts_implementation", None)


def use_experts(model: nn.Module, choice: str) -> str | None:
    """`precompute.experts` on a loaded teacher: `auto` leaves transformers' choice; -> what runs (None: a dense
    model, where the setting means nothing)."""
    if expert_count(model.config) is None:
        return None
    if choice == FUSED_EXPERTS:
        problem = _fused_problem(next(model.parameters()).device)
        if problem:
            raise ConfigError(f"precompute.experts: {FUSED_EXPERTS} {problem}; set precompute.experts: auto")
        register_fused_experts()
    if choice != "auto":
        setter = getattr(model, "set_experts_implementation", None)
        if setter is None:
            raise ConfigError(f"precompute.experts: {choice} needs a transformers that can set a model's experts "
                              "implementation (5.x); set precompute.experts: auto")
        try:
            setter(choice)
        except (ValueError, ImportError, RuntimeError) as error:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(f"precompute.experts: {choice} cannot run this teacher: {first}") from None
    return experts_in_use(model)


def _fused_problem(device: torch.device) -> str | None:
    """Why the fused Triton experts cannot run here, or None."""
    if not triton_available():
        return "needs Triton (pip install triton)"
    if device.type != "cuda" and not interpreting():
        return f"runs on CUDA, not {device.type}"
    return None


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pass_settings(variant: str) -> dict[str, Any]:
    """The pass's settings that run `variant`: {"experts": ..., "compile_body": ...} (`precompute.*`)."""
    return {"experts": COMPILED.get(variant, variant), "compile_body": variant in COMPILED}


def _runner(model: nn.Module, variant: str, compile_backend: str) -> Callable[[Tensor], Tensor]:
    """A function input_ids -> the body's hidden states under `variant` (the experts set as it needs)."""
    settings = pass_settings(variant)
    use_experts(model, settings["experts"])
    return teacher_body_runner(model, compiled=settings["compile_body"], backend=compile_backend)


def measure_body_variants(model: nn.Module, input_ids: Tensor, variants: tuple[str, ...] = VARIANTS,
                          repeats: int = 3, compile_backend: str = "inductor",
                          moe_tilings: Sequence[GemmTiles] = ()) -> Iterator[dict[str, Any]]:
    """One record per variant: tokens/s of the body (the best of `repeats` after a warm-up, the compile's own
    seconds apart), the largest difference of its hidden states from eager's (absolute and relative to eager's
    largest), or the one-line error that stopped it; `kdflow_fused` once more in each of `moe_tilings` (its
    record's `moe_tiles`; the device's own is `default_tiles`; a compiled body's fused experts take the device's).
    The model's own implementation is restored after."""
    if expert_count(model.config) is None:
        raise ValueError("the body's variants are a MoE teacher's: this teacher has no experts")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown body variants {unknown}; known: {', '.join(VARIANTS)}")
    device, tokens = input_ids.device, input_ids.numel()
    before = experts_in_use(model)
    try:
        with torch.inference_mode():
            reference = _runner(model, "eager", compile_backend)(input_ids).float()
            scale = float(reference.abs().max()) or 1.0
            runs = [(variant, None) for variant in variants]
            runs += [(FUSED_EXPERTS, tiles) for tiles in moe_tilings if FUSED_EXPERTS in variants]
            for variant, tiles in runs:
                record: dict[str, Any] = {"variant": variant, "tokens": tokens}
                fused = pass_settings(variant)["experts"] == FUSED_EXPERTS
                if fused and _fused_problem(device):
                    yield record | {"skipped": f"{FUSED_EXPERTS} {_fused_problem(device)}"}
                    continue
                if fused:
                    record |= _tiling_record(model, tokens, tiles)
                try:
                    with moe_tiling(tiles):
                        runner = _runner(model, variant, compile_backend)
                        out, record["first_call_s"], best = _timed(runner, input_ids, repeats)
                        record |= getattr(runner, "compile_stats", {})  # a compiled body: its graphs and breaks
                except Exception as error:  # noqa: BLE001 - a variant that cannot run is a result, not a crash
                    text = str(error).strip().splitlines()
                    yield record | {"error": f"{type(error).__name__}: {text[0] if text else ''}"[:300]}
                    continue
                diff = float((out.float() - reference).abs().max())
                yield record | {"experts": experts_in_use(model), "tokens_per_s": round(tokens / best, 1),
                                "max_abs_diff": diff, "max_rel_diff": diff / scale}
    finally:
        if before is not None:
            use_experts(model, before)


def _timed(run: Callable[[Tensor], Tensor], input_ids: Tensor, repeats: int) -> tuple[Tensor, float, float]:
    """-> (the output, the warm-up's seconds: for `compiled`, the compile itself, the best of `repeats` seconds)."""
    device = input_ids.device
    started = time.perf_counter()
    out = run(input_ids)
    _synchronise(device)
    first = round(time.perf_counter() - started, 3)
    best = float("inf")
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        out = run(input_ids)
        _synchronise(device)
        best = min(best, time.perf_counter() - started)
    return out, first, best


def _tiling_record(model: nn.Module, tokens: int, tiles: GemmTiles | None) -> dict[str, Any]:
    """The fused experts' tiling for a record: the one given, or the device's default at these slots."""
    if tiles is not None:
        return {"moe_tiles": str(tiles), "moe_tiles_default": False}
    chosen = getattr(text_config(model.config), "num_experts_per_tok", None)
    if chosen is None:
        return {"moe_tiles_default": True}
    slots = tokens * int(chosen)
    first = next(model.parameters())
    dtype = getattr(model, "dtype", first.dtype)  # the layers' compute dtype (a 4-bit weight's storage is bytes)
    return {"moe_tiles": str(default_tiles(slots, expert_count(model.config) or 1, first.device, dtype)),
            "moe_tiles_default": True}


def _other_tiling(record: dict[str, Any]) -> bool:
    return record.get("moe_tiles_default") is False


def fastest_correct(records: list[dict[str, Any]], tolerance: float, compiled: bool = False) -> str | None:
    """The variant with the most tokens/s among those whose hidden states are within `tolerance` of eager's
    (relative to their largest), as the pass runs them (a record of another tiling than the device's is not): an
    experts implementation, or with `compiled` also a compiled body (`pass_settings` gives what to set); None when
    none is."""
    among = VARIANTS if compiled else EXPERTS
    correct = [r for r in records if r.get("variant") in among and "tokens_per_s" in r
               and r["max_rel_diff"] <= tolerance and not _other_tiling(r)]
    return max(correct, key=lambda r: r["tokens_per_s"])["variant"] if correct else None


def measure_pass_experts(model: nn.Module, input_ids: Tensor, compile_body: bool, repeats: int = 2,
                         tolerance: float = EXPERTS_TOLERANCE,
                         compile_backend: str = "inductor") -> tuple[list[dict[str, Any]], str | None]:
    """The experts implementations as a pass with this `compile_body` would run them: each one eager, or, for a
    compiled pass, the compiled body with each (`compiled`, `compiled_fused`: an implementation fastest eager may
    not be fastest compiled) -> (the records, the fastest correct one's `precompute.experts`, or None)."""
    variants = tuple(COMPILED) if compile_body else EXPERTS
    records = list(measure_body_variants(model, input_ids, variants, repeats, compile_backend))
    best = fastest_correct(records, tolerance, compiled=compile_body)
    return records, pass_settings(best)["experts"] if best else None
