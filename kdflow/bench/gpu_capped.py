"""The 24 GB promise, measured (issue 44, item 3): the 32-layer 4-bit reference teacher and its pass under a cap
of 24 GiB of device memory (`torch.cuda.set_per_process_memory_fraction`), at the shipped llmjp config's
micro-batch and below it, to find the largest that fits.

The teacher cannot be built in bf16 first under the cap (60 GiB), so it is built layer by layer: the model made on
the meta device, then each part given device memory, random values (std 0.02, norms one) and, for a decoder
layer, quantised at once as the loader quantises (random_teacher.quantise_in_place: NF4 Linear4bit layers and
the loader's `quantise_fused_experts`), so no more than one layer is ever in 16 bits. Each candidate micro-batch
runs the pass's step (`TeacherTopkStep`) once to warm up and once timed; out of memory is its outcome, not an
error. The cap is a card's: 24 GiB less the CUDA context, which such a card holds too, outside the allocator. The
candidates run under each experts implementation in `EXPERTS`: transformers' `grouped_mm` dequantises a layer's
experts whole per forward (1.8 GiB at the reference shapes), `kdflow_fused` reads the NF4 values in its GEMM's
loads, so it may fit a larger micro-batch (skipped, and recorded so, where Triton or CUDA is missing). On a CPU
(the rehearsal) there is no cap: the same code runs at the rehearsal's sizes.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from kdflow.bench.gpu_plan import CAP_GIB, reference_config
from kdflow.schemas.errors import first_line
from kdflow.tasks.common.units import GIB

LLMJP_MICRO_BATCH, LLMJP_SEQ_LEN = 56, 512  # configs/llmjp.yaml and prefect.yaml as shipped
EXPERTS = ("grouped_mm", "kdflow_fused")  # transformers' default; kdflow's, without the per-layer dequantisation


def capped(shapes: dict[str, int], device: str, cap_gib: float, seq_len: int, micro_batches: list[int],
           top_k: int, chunk_tokens: int) -> dict[str, Any]:
    """The step: the cap set (CUDA), the teacher built under it, each micro-batch tried largest first under each
    experts implementation; the largest that ran is `fits_micro_batch` (and per implementation,
    `fits_by_experts`). The cap is lifted afterwards, whatever happened."""
    import torch

    from kdflow.bench.gpu_models import build_quantised
    from kdflow.schemas.errors import ConfigError
    from kdflow.tasks.common.device_memory import cap_device_memory, uncap_device_memory
    from kdflow.tasks.common.fused_experts import experts_left_unquantised, weight_bytes
    from kdflow.tasks.teacher.body_variants import use_experts
    from kdflow.tasks.teacher.topk import TeacherTopkStep

    cuda = device.startswith("cuda")
    out: dict[str, Any] = {"layers": shapes["num_hidden_layers"], "seq_len": seq_len, "top_k": top_k,
                           "cap_gib": cap_gib if cuda else None, "candidates": []}
    if cuda:
        out |= cap_device_memory(device, cap_gib)
        torch.cuda.reset_peak_memory_stats()
    try:
        started = time.perf_counter()
        model = build_quantised(shapes, device)
        out |= {"build_s": round(time.perf_counter() - started, 2),
                "weights_gib": round(sum(weight_bytes(model).values()) / GIB, 3),
                "experts_left_unquantised": experts_left_unquantised(model)}
        if cuda:
            out["peak_after_build_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        step = TeacherTopkStep(model, top_k, chunk_tokens)
        for experts in EXPERTS:
            try:
                use_experts(model, experts)
            except ConfigError as error:
                out["candidates"].append({"experts": experts, "status": "skipped", "error": str(error)[:200]})
                continue
            for rows in sorted(micro_batches, reverse=True):
                out["candidates"].append({"experts": experts}
                                         | _try(step, shapes["vocab_size"], rows, seq_len, device))
        del model, step
    finally:
        if cuda:
            uncap_device_memory(device)
    ran = [c["micro_batch"] for c in out["candidates"] if c["status"] == "ok"]
    out["fits_micro_batch"] = max(ran) if ran else None
    out["fits_by_experts"] = {experts: max((c["micro_batch"] for c in out["candidates"]
                                            if c["experts"] == experts and c["status"] == "ok"), default=None)
                              for experts in EXPERTS}
    out["llmjp_micro_batch_fits"] = LLMJP_MICRO_BATCH in ran
    if out["experts_left_unquantised"]:
        raise RuntimeError(f"expert weights left unquantised: {out['experts_left_unquantised'][0]}")
    broken = [c for c in out["candidates"] if c["status"] == "failed" and c["experts"] == EXPERTS[0]]
    if broken:  # transformers' own path failing is a fault of the check, not an outcome
        raise RuntimeError(f"micro-batch {broken[0]['micro_batch']} failed: {broken[0]['error']}")
    return out


def _try(step: Any, vocab: int, rows: int, seq_len: int, device: str) -> dict[str, Any]:
    import torch

    cuda = device.startswith("cuda")
    ids = torch.randint(2, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(rows)).to(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        with torch.inference_mode():
            step(ids)  # warm-up
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(ids)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
    except torch.OutOfMemoryError as error:
        return {"micro_batch": rows, "status": "out of memory", "error": first_line(error)[:160]}
    except Exception as error:  # noqa: BLE001 - e.g. a kernel that does not compile here: this candidate's outcome
        return {"micro_batch": rows, "status": "failed", "error": f"{type(error).__name__}: {first_line(error)}"[:200]}
    record = {"micro_batch": rows, "status": "ok", "tokens_per_s": round(ids.numel() / seconds, 1)}
    if cuda:
        record["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    return record


def check_step(size: dict[str, Any], device: str) -> dict[str, Any]:
    """`capped_24gib` at the check's sizes: the llmjp config's micro-batch and halvings of it (full size)."""
    from kdflow.schemas.config import PrecomputeConfig
    from kdflow.tasks.teacher.topk import topk_chunk_tokens

    settings, shapes = size["capped"], size["shapes"]
    chunk = topk_chunk_tokens(PrecomputeConfig(), shapes["vocab_size"])
    return capped(shapes, device, CAP_GIB, settings["seq_len"], settings["micro_batches"], size["top_k"], chunk)


def tune_step(work: Path, size: dict[str, Any], device: str, tokenizer: Path) -> dict[str, Any]:
    """`tune_capped_24gib`: `kdflow tune precompute --random-weights --memory-gib 24` as the command runs it (each
    candidate a fresh process), on the 32-layer reference teacher made from its config.json alone (a folder holding
    that and the check's tokenizer: 61 GiB of weights would not fit the machine's disk) in 4-bit, at the llmjp
    config's seq_len, on rows of Python's documentation. On a CPU (the rehearsal) the same, uncapped, at the
    rehearsal's sizes. -> the candidates and the recommendation."""
    import yaml

    from kdflow.tasks.common.launch import config_file
    from kdflow.tasks.teacher import tune_search
    from kdflow.tasks.teacher.tune_file import check_tune_request

    cuda = device.startswith("cuda")
    shapes, seq_len = size["shapes"], size["capped"]["seq_len"]
    folder = work / "reference-config"
    folder.mkdir(parents=True, exist_ok=True)
    for name in tokenizer.iterdir():
        if name.is_file():
            shutil.copy(name, folder / name.name)
    reference_config(shapes, max_position_embeddings=4096).save_pretrained(folder)
    sizes = size["capped"]["tune_candidates"]
    path = work / "tune-capped.yaml"
    path.write_text(yaml.safe_dump({
        "run_root": str(work / "tune-capped-run"), "dataset": {"path": str(work / "docs.jsonl")}, "seq_len": seq_len,
        "teacher": {"model": str(folder), "load_in_4bit": True, "device": device, "dtype": "bfloat16"},
        "precompute": {"top_k": size["top_k"], "micro_batch": sizes[-1]}}), encoding="utf-8")
    request = check_tune_request(path, micro_batches=",".join(map(str, sizes)), batches=2, random_weights=True)
    worker_args = tune_search.worker_options(device, True, CAP_GIB if cuda else None)
    with config_file(request.config, "kdflow-gpu-tune-capped-") as resolved:
        candidates = tune_search.tune(resolved, request.sizes, batches=2, timeout_s=150, worker_args=worker_args)
    result = tune_search.summary(candidates, 0.0)  # the cap is the card: whatever ran within it fits
    return {"layers": shapes["num_hidden_layers"], "seq_len": seq_len, "cap_gib": CAP_GIB if cuda else None,
            "command": f"kdflow tune precompute --micro-batches {','.join(map(str, sizes))} --batches 2 "
                       f"{' '.join(worker_args)}",
            "candidates": result["candidates"], "recommended_micro_batch": result["recommended_micro_batch"],
            "llmjp_micro_batch_fits": any(c["micro_batch"] == LLMJP_MICRO_BATCH and c["status"] == "ok"
                                          for c in result["candidates"])}
