"""`kdflow bench train-step`'s child half: one variant measured in this (fresh) process (`measure`).

The variants, the memory numbers and how they are taken: see `kdflow.bench.train_step`.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from kdflow.bench.harness import peak_bytes, reset_peak, synchronise
from kdflow.tasks.common.units import GIB


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """The config with dotted keys (`student.steps`) set, validated again."""
    from kdflow.schemas.config_io import config_from_dict, set_dotted

    data = config.model_dump(mode="json")
    for key, value in overrides.items():
        set_dotted(data, key, value)
    return config_from_dict(data, source="kdflow bench train-step")


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant of `spec` (config, variant, label, warmup, steps) in this process; -> its JSON record."""
    import torch

    from kdflow.schemas.config_io import config_from_dict
    from kdflow.schemas.errors import KDFlowError
    from kdflow.tasks.student.distributed import rank_device

    config = config_from_dict(spec["config"])
    student = config.student
    device = rank_device(student.device, 0, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the peak-memory counters read the current device
    record: dict[str, Any] = {"variant": spec["label"], "batch": student.batch_size, "seq_len": config.seq_len,
                              "tokens_per_step": student.batch_size * config.seq_len, "device": str(device),
                              "threads": torch.get_num_threads(), "load_avg": [round(os.getloadavg()[0], 2)]}
    try:
        if spec["variant"] == "stage":
            result = _measure_stage(config, spec["warmup"], spec["steps"], device)
        else:
            result = _measure_step(config, spec["variant"], spec["warmup"], spec["steps"], device,
                                   check_float32=spec.get("check_float32", False))
    except KDFlowError as error:
        return record | {"skipped": str(error)}
    except torch.OutOfMemoryError:
        return record | {"error": "out of memory"}
    record |= result
    record["tok_s"] = round(record["tokens_per_step"] * spec["steps"] / record["seconds"], 1)
    record["peak_gib"] = round(record["peak_bytes"] / GIB, 3)
    record["peak_total_gib"] = round(record["peak_total_bytes"] / GIB, 3)
    record["load_avg"].append(round(os.getloadavg()[0], 2))
    return record


def _first_batch(config: Any, tokenizer: Any) -> tuple[Any, str, Any]:
    """The first training batch of the config's stores, else a synthetic one; -> (DistillBatch, source,
    DistillData or None)."""
    from kdflow.schemas.errors import KDFlowError
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.data import open_distill_data

    batch_size = config.student.batch_size
    try:
        data = open_distill_data(open_run_root(config), training_settings(config), tokenizer)
        return data.train_batch(data.rank_rows(0, batch_size, 0, 1)), "stores", data
    except KDFlowError as error:
        return _synthetic_batch(batch_size, config.seq_len, config.precompute.top_k, len(tokenizer)), \
            f"synthetic ({error})", None


def _new_student(config: Any, tokenizer: Any, data: Any) -> Any:
    """The student the stage would start from: pruned from the teacher as training prunes it (`student.prune`, on
    the stores' rows), else `init_from` or a seeded new one."""
    from kdflow.schemas.errors import ConfigError
    from kdflow.tasks.student.model import build_student
    from kdflow.tasks.student.prune import pruned_as_configured

    if config.student.prune is None:
        return build_student(config.student, config.seq_len, tokenizer)
    if data is None:
        raise ConfigError("student.prune measures the teacher's blocks on the stores' training rows, and this "
                          f"config has no stores at seq_len {config.seq_len}")
    return pruned_as_configured(config.teacher, config.student.prune, data, tokenizer)[0]


def _synthetic_batch(rows: int, seq_len: int, top_k: int, vocab: int) -> Any:
    """Random tokens and a teacher top-K with K distinct ids per position and 10% tail mass (float16)."""
    import math

    import torch

    from kdflow.tasks.student.data import DistillBatch

    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, seq_len), generator=gen)  # (n, T)
    start = torch.randint(0, vocab, (rows, seq_len, 1), generator=gen)
    topk_ids = ((start + torch.arange(top_k) * max(1, vocab // top_k)) % vocab).to(torch.int32)  # (n, T, K)
    logprobs = torch.log_softmax(torch.randn(rows, seq_len, top_k, generator=gen) * 2, dim=-1) + math.log(0.9)
    topk_logprobs = logprobs.sort(dim=-1, descending=True).values.half()  # (n, T, K)
    tail_logprob = torch.full((rows, seq_len), math.log(0.1), dtype=torch.float32)  # (n, T) the 10% outside the ids
    return DistillBatch(input_ids=input_ids, topk_ids=topk_ids, topk_logprobs=topk_logprobs, tail_logprob=tail_logprob)


def _measure_step(config: Any, variant: str, warmup: int, steps: int, device: Any, *,
                  check_float32: bool = False) -> dict[str, Any]:
    """(a) plain or (b) fused: the same batch every step, `warmup` steps, then `steps` timed ones; with
    `check_float32` (fused only), first `against_float32`."""
    import torch.nn.functional as F

    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.distributed import clip_grad_norm
    from kdflow.tasks.student.options import apply_student_options
    from kdflow.tasks.student.steps import DistillLoss, autocast_for, build_optimizer, distill_loss, next_token_labels

    student = config.student
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    batch, source, data = _first_batch(config, tokenizer)
    batch = batch.to(device)
    model = apply_student_options(_new_student(config, tokenizer, data).to(device), student, device)
    model.train()
    module = DistillLoss(model)
    optimizer, scheduler = build_optimizer(model, student)
    autocast = autocast_for(device, student.autocast_bf16)
    rows, seq_len = batch.input_ids.shape
    counts = (float(rows * seq_len), float(rows * (seq_len - 1)))
    labels = next_token_labels(batch.input_ids).flatten()  # (n * T,)
    checked = (against_float32(model, lambda context: distill_loss(module, batch, student.kd, counts, context)[0],
                               autocast) if variant == "fused" and check_float32 else None)

    def one_step() -> float:
        if variant == "plain":
            with autocast:
                logits = model(input_ids=batch.input_ids, use_cache=False).logits  # (n, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=-100)
            del logits
        else:
            loss = distill_loss(module, batch, student.kd, counts, autocast)[0]
        loss.backward()
        clip_grad_norm(list(model.parameters()), student.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return float(loss.detach())

    warmup_s = []
    for _ in range(warmup):
        started = time.perf_counter()
        one_step()
        synchronise(device)
        warmup_s.append(round(time.perf_counter() - started, 3))
    reset_peak(device)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = one_step()
        synchronise(device)
        seconds.append(time.perf_counter() - started)
    peak_total = peak_bytes(device)
    watch = _TensorPeak(device)
    watch.start()
    one_step()  # one more, for the tensor peak (the profiler slows it: not timed)
    return {"topk": source, "params": sum(p.numel() for p in model.parameters()), "seconds": round(sum(seconds), 3),
            "step_s": sorted(round(s, 3) for s in seconds),
            "warmup_s": warmup_s, "loss": round(loss, 5), "peak_bytes": watch.stop(),
            "peak_total_bytes": int(peak_total), "options": _options_of(student)} | (
                {"float32_check": checked} if checked is not None else {})


# Tolerances of `against_float32`: bf16 autocast rounds the matmul inputs to 8 bits of mantissa (relative 2^-9).
FLOAT32_LOSS_RTOL = 1e-2
FLOAT32_GRAD_RTOL = 5e-2


def against_float32(model: Any, loss_of: Any, autocast: Any) -> dict[str, Any]:
    """The first step's loss and gradients under `autocast` against the same step with autocast off (the
    float32 reference: the student's weights are float32), from the same weights; no optimiser step. The
    gradients compare as one vector: |g - g32| / |g32|, and the largest such ratio of a single parameter."""
    import contextlib

    import torch

    results = []
    for context in (autocast, contextlib.nullcontext()):
        model.zero_grad(set_to_none=True)
        loss = loss_of(context)
        loss.backward()
        grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads))
    model.zero_grad(set_to_none=True)
    (loss, grads), (reference, grads32) = results
    diff = torch.sqrt(sum(((grads[n] - g) ** 2).sum() for n, g in grads32.items()))
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads32.values()))
    worst = max((float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)), n) for n, g in grads32.items())
    loss_rel = abs(loss - reference) / max(abs(reference), 1e-30)
    grad_rel = float(diff / norm.clamp_min(1e-30))
    return {"autocast": isinstance(autocast, torch.autocast), "loss": round(loss, 6),
            "float32_loss": round(reference, 6),
            "loss_rel_diff": loss_rel, "grad_rel_diff": grad_rel, "grad_worst_param_rel_diff": worst[0],
            "grad_worst_param": worst[1], "tolerance": {"loss": FLOAT32_LOSS_RTOL, "grad": FLOAT32_GRAD_RTOL},
            "ok": loss_rel <= FLOAT32_LOSS_RTOL and grad_rel <= FLOAT32_GRAD_RTOL}


def _measure_stage(config: Any, warmup: int, steps: int, device: Any) -> dict[str, Any]:
    """(c) `train()` on the real shards with a scratch student; timed between the on_step calls of steps
    `warmup` and `warmup + steps`, so everything the loop does between two steps is inside."""
    from kdflow.schemas.layout import STUDENTS_DIR
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_stores
    from kdflow.tasks.student.jsonl_log import read_jsonl
    from kdflow.tasks.student.train import train

    name = f"bench-train-step-{os.getpid()}"
    total = warmup + steps + 1  # the last one for the tensor peak, under the profiler
    config = with_overrides(config, {"student.name": name, "student.steps": total, "student.eval_every": 0,
                                      "student.save_every": total + 1, "student.eval_sequences": 1})
    # no stores at this seq_len: skipped, with the reason
    open_stores(open_run_root(config), training_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    run_root = open_run_root(config)
    student_dir = run_root.path(STUDENTS_DIR, name)
    timed_end = warmup + steps
    marks: dict[int, tuple[float, int]] = {}
    watch = _TensorPeak(device)

    def on_step(record: dict[str, Any]) -> bool:
        synchronise(device)
        if record["step"] == warmup:
            marks[warmup] = (time.perf_counter(), reset_peak(device))
        elif record["step"] == timed_end:
            marks[timed_end] = (time.perf_counter(), peak_bytes(device))
            watch.start()
        elif record["step"] == total:
            marks[total] = (0.0, watch.stop())
        return record["step"] >= total  # stop: no closing evaluation or final model

    try:
        summary = train(open_run_root(config), training_settings(config), on_step=on_step)
        metrics = read_jsonl(run_root, f"{student_dir}/metrics.jsonl")
    finally:
        if run_root.is_local:
            shutil.rmtree(student_dir, ignore_errors=True)
        elif run_root.exists(student_dir):
            run_root.fs.rm(student_dir, recursive=True)
    (start, _), (end, peak_total), (_, peak) = marks[warmup], marks[timed_end], marks[total]
    timed = [r for r in metrics if warmup < r["step"] <= timed_end]
    step_only = sum(r["tokens"] / r["tokens_per_s"] for r in timed)  # seconds inside StudentRun.step()
    return {"topk": "stores", "params": summary["params"], "seconds": round(end - start, 3),
            "step_only_s": round(step_only, 3), "loss": round(timed[-1]["loss"], 5), "peak_bytes": peak,
            "peak_total_bytes": int(peak_total), "options": _options_of(config.student)}


class _TensorPeak:
    """The most bytes of tensors alive at once between start() and stop(), beyond those alive at start()."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
            return
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.start()

    def stop(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - self.before)
        self.profiler.stop()
        events = [event for event in self.profiler.profiler.kineto_results.events()
                  if event.name() == "[memory]" and str(event.device_type()) == "DeviceType.CPU"]
        live = peak = 0
        for event in sorted(events, key=lambda event: event.start_ns()):  # + allocations, - frees
            live += event.nbytes()
            peak = max(peak, live)
        return int(peak)


def _options_of(student: Any) -> dict[str, Any]:
    return {"gradient_checkpointing": student.gradient_checkpointing, "compile": student.compile,
            "attn_implementation": student.attn_implementation, "chunk_tokens": student.kd.chunk_tokens}
