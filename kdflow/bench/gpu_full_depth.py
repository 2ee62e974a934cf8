"""The GPU check's full-depth teacher (issue 44, item 2): the reference teacher at all of its layers, random
weights, built in the device's memory (never written: 61 GiB of bf16 would not fit the machine's disk), timed in
bf16 and then, quantised in place as the loader quantises, in 4-bit: the model body alone, the bare forward to full
logits, and the pass's step (body + chunked log-sum-exp and top-K, `TeacherTopkStep`), on the same rows.

Up to now the full-depth rate was a line through 2 and 4 layers, which gave the pass a per-layer cost below its
own forward's (impossible: the pass holds a forward). Here it is measured. MFU is given against both the bf16
matmul rate measured in the same call (a large square GEMM, `matmul_tflops`) and the datasheet's dense bf16 peak
of the device it ran on (`DATASHEET_BF16_TFLOPS`), each named in the record.

The step fits the device it finds. On an H200 (139 GiB) every mode runs in both precisions. On an H100 (78 GiB)
the bf16 weights (60 GiB) fit, but the bare forward's whole bf16 logits beside them may not: a mode that runs out
of memory is recorded so (`out_of_memory`) and the others go on. Where the bf16 weights themselves do not fit,
bf16 is skipped and the 4-bit teacher is built layer by layer, as the capped step builds it.

4-bit as the loader makes it (`load_teacher`: bitsandbytes NF4, no double quantisation, compute in the model's
dtype): every nn.Linear but the lm_head becomes a `Linear4bit`, and the fused 3-D experts are quantised by
`quantise_fused_experts`, the loader's own function; the expert check then reads what the model holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kdflow.bench.gpu_plan import BF16_PEAK_TFLOPS, model_parameters, teacher_bytes
from kdflow.schemas.errors import first_line
from kdflow.tasks.common.units import GIB

# Dense bf16 tensor-core peaks (NVIDIA's datasheets, without sparsity; the RTX 3090's with float32 accumulation, as
# torch's bf16 matmuls run), by a part of the name torch gives the device, the most specific first.
DATASHEET_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("A100", 312.0),
    ("RTX 3090", 71.0))


def datasheet_peak(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak of the device torch names so, or None for a device not in the table."""
    return next((tflops for part, tflops in DATASHEET_BF16_TFLOPS if part in device_name), None)


def matmul_tflops(device: str, size: int, repeats: int = 10) -> float:
    """The device's bf16 matmul rate: the best of `repeats` square GEMMs of `size`, in TFLOP/s."""
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        sync()
        started = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e12


def _best_seconds(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    run()  # warm-up: allocator, kernels chosen
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


# The pass's step as kdflow can run it beside its defaults (the slab head, transformers' experts: `topk`), on CUDA
# with Triton: (precompute.head, precompute.experts). The full-depth target is judged on the fastest.
KDFLOW_PASS_MODES = {"topk_tiled_fused": ("tiled", "kdflow_fused"), "topk_gemm_fused": ("tiled-gemm", "kdflow_fused")}


def time_modes(model: Any, input_ids: Any, top_k: int, chunk_tokens: int,
               repeats: int) -> tuple[dict[str, float], dict[str, str], dict[str, str]]:
    """Tokens a second of the body, the bare forward (the model's own lm_head in its dtype, as `kdflow bench
    teacher-pass` times it) and the pass's step on `input_ids` (best of `repeats`): as configured by default
    (`topk`) and, on CUDA with Triton, in `KDFLOW_PASS_MODES`; and, apart, each mode that ran out of device memory
    (its outcome: on an H100 the bf16 teacher's whole logits do not fit beside its weights), and each of
    `KDFLOW_PASS_MODES` that failed otherwise (its error; the default modes' errors are the step's)."""
    import torch

    from kdflow.tasks.common.float32_logits import Float32Logits
    from kdflow.tasks.common.models import body_hidden_states, output_layer
    from kdflow.tasks.teacher.body_variants import experts_in_use, use_experts
    from kdflow.tasks.teacher.tile_stats_kernel import interpreting, triton_available
    from kdflow.tasks.teacher.topk import TeacherTopkStep

    step = TeacherTopkStep(model, top_k, chunk_tokens)
    cuda = input_ids.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    own_head = output_layer(model)
    bare_head = own_head.linear if isinstance(own_head, Float32Logits) else own_head

    def forward() -> None:
        model.set_output_embeddings(bare_head)
        try:
            model(input_ids=input_ids, use_cache=False).logits  # noqa: B018 - the logits are the work
        finally:
            model.set_output_embeddings(own_head)

    modes: dict[str, tuple[Callable[[], Any], str | None]] = {
        "body": (lambda: body_hidden_states(model, input_ids), None), "forward": (forward, None),
        "topk": (lambda: step(input_ids), None)}
    if triton_available() and (cuda or interpreting()):  # interpreted: the suite's check of the switching
        modes |= {mode: (partial(TeacherTopkStep(model, top_k, chunk_tokens, head=head), input_ids), experts)
                  for mode, (head, experts) in KDFLOW_PASS_MODES.items()}
    rates: dict[str, float] = {}
    out_of_memory: dict[str, str] = {}
    failed: dict[str, str] = {}
    with torch.inference_mode():
        for mode, (run, experts) in modes.items():
            before = experts_in_use(model)
            try:
                if experts:
                    use_experts(model, experts)
                rates[mode] = round(input_ids.numel() / _best_seconds(run, repeats, sync), 1)
            except torch.OutOfMemoryError as error:
                out_of_memory[mode] = first_line(error)[:160]
            except Exception as error:  # noqa: BLE001 - a variant that fails is its outcome; the defaults' stand
                if mode not in KDFLOW_PASS_MODES:
                    raise
                failed[mode] = f"{type(error).__name__}: {first_line(error)[:160]}"
            finally:
                if experts and before:
                    use_experts(model, before)
                if cuda:
                    torch.cuda.empty_cache()
    return rates, out_of_memory, failed


def mfu(shapes: dict[str, int], layers: int, rates: dict[str, float], tflops: float) -> dict[str, float]:
    """Each mode's share of `tflops`: 2 FLOPs a matmul parameter a token (attention's scores not counted); the body
    stops before the lm_head, whose parameters are then left out."""
    counts = model_parameters(shapes, layers)
    active, head = counts["activated"] - counts["embedding"], shapes["vocab_size"] * shapes["hidden_size"]
    return {mode: round(2 * (active - head * (mode == "body")) * rate / (tflops * 1e12), 4)
            for mode, rate in rates.items()}


def full_depth(shapes: dict[str, int], device: str, micro_batch: int, seq_len: int, top_k: int, chunk_tokens: int,
               repeats: int, matmul_size: int, free_bytes: int | None = None) -> dict[str, Any]:
    """The step: the full-depth teacher built once in bf16, timed, quantised in place to 4-bit, timed again. Where
    its bf16 weights would take more than 90% of the device's free memory (`free_bytes`, read off a CUDA device;
    none on a CPU), or building them runs out of memory, bf16 is recorded as skipped and the 4-bit teacher is
    built layer by layer (gpu_models.build_quantised) and timed alone."""
    import torch

    from kdflow.bench.gpu_models import build_quantised, build_random
    from kdflow.tasks.common.random_teacher import quantise_in_place
    from kdflow.tasks.common.fused_experts import experts_left_unquantised, weight_bytes
    from kdflow.tasks.common.teacher_loading import float32_lm_head

    layers = shapes["num_hidden_layers"]
    cuda = device.startswith("cuda")
    measured = matmul_tflops(device, matmul_size)
    name = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu"
    datasheet = datasheet_peak(name) if cuda else None
    out: dict[str, Any] = {"layers": layers, "micro_batch": micro_batch, "seq_len": seq_len, "top_k": top_k,
                           "what": "measured at full depth (random weights)", "device_name": name,
                           "roofline_tflops": {"measured_bf16_matmul": round(measured, 4),
                                               "kinds_md_h200_bf16_matmul": BF16_PEAK_TFLOPS,
                                               "datasheet_dense_bf16": datasheet}}
    if free_bytes is None and cuda:
        torch.cuda.empty_cache()
        free_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
    started = time.perf_counter()
    model = None
    bf16_bytes = teacher_bytes(shapes, layers, False)
    if free_bytes is not None and bf16_bytes > 0.9 * free_bytes:
        out["bf16"] = {"skipped": f"its weights ({bf16_bytes / GIB:.1f} GiB) > 90% of the device's free memory "
                                  f"({free_bytes / GIB:.1f} GiB): 4-bit alone, built layer by layer"}
    else:
        try:
            model = build_random(shapes, layers, device)
            float32_lm_head(model)  # as the pass loads its teacher (`teacher.lm_head_float32`, the default)
        except torch.OutOfMemoryError as error:
            model = None
            if cuda:
                torch.cuda.empty_cache()
            out["bf16"] = {"skipped": f"out of memory building it ({first_line(error)[:160]}): 4-bit alone, built "
                                      "layer by layer"}
    if model is None:
        model = build_quantised(shapes, device)
    out["build_s"] = round(time.perf_counter() - started, 2)
    ids = torch.randint(2, shapes["vocab_size"], (micro_batch, seq_len),
                        generator=torch.Generator().manual_seed(0)).to(device)
    timed = ("4bit",) if "bf16" in out else ("bf16", "4bit")  # bf16 skipped: the model was built in 4-bit
    for bits in timed:
        if bits == "4bit" and "bf16" in timed:
            started = time.perf_counter()
            quantise_in_place(model)
            out["quantise_s"] = round(time.perf_counter() - started, 2)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rates, out_of_memory, failed = time_modes(model, ids, top_k, chunk_tokens, repeats)
        held = sum(weight_bytes(model).values())
        record: dict[str, Any] = {"tokens_per_s": rates, "weight_bytes": held, "weights_gib": round(held / GIB, 3),
                                  "mfu_of_measured_matmul": mfu(shapes, layers, rates, measured)}
        if datasheet is not None:
            record["mfu_of_datasheet_peak"] = mfu(shapes, layers, rates, datasheet)
        if {"topk", "forward"} <= set(rates):
            record["topk/forward"] = round(rates["topk"] / rates["forward"], 4)
        if out_of_memory:
            record["out_of_memory"] = out_of_memory
        if failed:
            record["failed"] = failed
        if cuda:
            record["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        if bits == "4bit":
            record["experts_left_unquantised"] = experts_left_unquantised(model)
        out[bits] = record
    if "tokens_per_s" in out["bf16"]:
        both = out["bf16"]["tokens_per_s"].keys() & out["4bit"]["tokens_per_s"].keys()
        out["4bit/bf16"] = {mode: round(out["4bit"]["tokens_per_s"][mode] / out["bf16"]["tokens_per_s"][mode], 4)
                            for mode in sorted(both)}
    del model
    if cuda:
        torch.cuda.empty_cache()
    if out["4bit"]["experts_left_unquantised"]:
        raise RuntimeError(f"expert weights left unquantised: {out['4bit']['experts_left_unquantised'][0]}")
    return out


def check_step(size: dict[str, Any], device: str, tuned: int | None) -> dict[str, Any]:
    """`full_depth` at the check's sizes: the tuned micro-batch (else the size's), the pass's default chunk."""
    from kdflow.schemas.config import PrecomputeConfig
    from kdflow.tasks.teacher.topk import topk_chunk_tokens

    settings, shapes = size["full_depth"], size["shapes"]
    chunk = topk_chunk_tokens(PrecomputeConfig(), shapes["vocab_size"])
    return full_depth(shapes, device, tuned or settings["micro_batch"], size["seq_len"], size["top_k"], chunk,
                      settings["repeats"], settings["matmul_size"])
