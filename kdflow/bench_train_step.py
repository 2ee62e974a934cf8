"""`kdflow bench train-step`: the student's training step against its limit, as JSON lines.

For a student config (the demo's by default) at a batch and seq_len, tok/s and peak memory of
  plain  (a) the student's forward with full (n, T, V) logits, next-token cross-entropy, backward, clipping,
             AdamW and scheduler step: what any trainer does;
  fused  (b) kdflow's step on the same batch: DistillLoss (the body's final hidden states into the fused
             top-K loss with the lm_head weight), backward, clipping, AdamW and scheduler step. The batch is
             the first training batch of the config's stores when they hold this seq_len, else a synthetic
             top-K batch (random tokens; K distinct ids a row, 10% tail mass);
  stage  (c) kdflow's whole training stage, `kdflow.tasks.student.train.train`, on the real shards: data
             loading, the metrics log, progress; no evaluation and no checkpoint inside the measured steps
             (a scratch student folder under the run root, removed afterwards);
then the ratios b/a and c/b of tok/s. `--options` measures (b) again with options switched on
(gradient_checkpointing, compile, attn=eager, combinations joined by '+') and prints each against (b).

Every measurement runs in a fresh Python process, so that nothing of one is left in another's memory;
`--repeats R` measures every variant R times, round robin, and keeps the fastest of each (the least disturbed
on a shared machine: quote ratios from one run, with the load averages each record carries).
Memory, two numbers per variant:
  peak_bytes        the most bytes of tensors alive at once during one more step, beyond those alive before
                    it (model, optimiser state, batch): activations, logits, gradients. On CPU from
                    torch.profiler's allocation events (so the allocator's caching cannot hide or inflate it);
                    on CUDA torch.cuda.max_memory_allocated over memory_allocated before the step;
  peak_total_bytes  what the whole process held at its peak over the measured steps: on CPU the resident
                    set's high-water mark (VmHWM, reset through /proc/self/clear_refs after the warm-up:
                    Python, torch, model, optimiser, allocator caches, mapped shards); on CUDA
                    torch.cuda.max_memory_allocated.
The CUDA paths are written to the same plan but were not run on this project's machines (no GPU there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from kdflow.bench_loss import _peak_bytes, _reset_peak, _synchronise

VARIANTS = ("plain", "fused", "stage")
OPTION_KEYS = {"gradient_checkpointing": ("student.gradient_checkpointing", True),
               "compile": ("student.compile", True)}
TARGETS = {"b/a": 0.95, "c/b": 0.95}
GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(json.loads(args.measure))), flush=True)
        return 0
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants must be a comma list of {', '.join(VARIANTS)}; got {args.variants}")
    options = [name for name in args.options.split(",") if name] if args.options else []
    config = _bench_config(args)
    base = {"config": config.model_dump(mode="json"), "warmup": args.warmup, "steps": args.steps}
    specs = [base | {"variant": variant, "label": variant} for variant in variants]
    for option in options:
        overrides = _option_overrides(option, parser)
        specs.append(base | {"variant": "fused", "label": f"fused+{option}",
                             "config": _with_overrides(config, overrides).model_dump(mode="json")})
    runs: dict[str, list[dict[str, Any]]] = {spec["label"]: [] for spec in specs}
    for _ in range(args.repeats):
        for spec in specs:
            runs[spec["label"]].append(_run_child(spec))
    records = {label: _fastest(measured) for label, measured in runs.items()}
    for record in records.values():
        print(json.dumps(record), flush=True)
    for name, (top, bottom) in {"b/a": ("fused", "plain"), "c/b": ("stage", "fused")}.items():
        if _measured(records.get(top)) and _measured(records.get(bottom)):
            print(json.dumps(_ratio(name, records[top], records[bottom]) | {"target": TARGETS[name]}), flush=True)
    for option in options:
        label = f"fused+{option}"
        if _measured(records.get(label)) and _measured(records.get("fused")):
            print(json.dumps(_ratio(f"{label}/fused", records[label], records["fused"])), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    from kdflow.cli import _parse_override

    parser = argparse.ArgumentParser(prog="kdflow bench train-step", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="student config (YAML); default: the demo's, configs/demo.yaml")
    parser.add_argument("--run-root", default="runs/demo", help="the demo's run root (without a config file)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: student.batch_size)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's seq_len)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured ones (compile, first touch)")
    parser.add_argument("--repeats", type=int, default=1, help="measure each variant this many times (round robin); "
                        "report the fastest")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: student.device)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of plain, fused, stage")
    parser.add_argument("--options", default="",
                        help="comma list of options to measure with the fused step: gradient_checkpointing, compile, "
                             "attn=sdpa|eager|flash_attention_2, or several joined by '+'")
    parser.add_argument("--set", action="append", type=_parse_override, metavar="KEY=VALUE",
                        help="override a config key (repeatable), e.g. --set student.kd.chunk_tokens=2048")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one measurement, in a child process
    return parser


def _bench_config(args: argparse.Namespace) -> Any:
    from kdflow.schemas.config import load_config

    overrides = dict(args.set or [])
    if args.config is not None:
        config = load_config(args.config, overrides)
    else:
        from kdflow.demo import demo_config, local_run_root

        config = _with_overrides(demo_config(local_run_root(args.run_root)), overrides)
    extra: dict[str, Any] = {}
    if args.batch is not None:
        extra["student.batch_size"] = args.batch
    if args.seq_len is not None:
        extra["seq_len"] = args.seq_len
    if args.device is not None:
        extra["student.device"] = args.device
    extra["student.grad_accum"] = 1  # one micro-batch per step in every variant
    return _with_overrides(config, extra)


def _with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    from kdflow.schemas.config import config_from_dict, set_dotted

    data = config.model_dump(mode="json")
    for key, value in overrides.items():
        set_dotted(data, key, value)
    return config_from_dict(data, source="kdflow bench train-step")


def _option_overrides(option: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for part in option.split("+"):
        if part.startswith("attn="):
            overrides["student.attn_implementation"] = part.removeprefix("attn=")
        elif part in OPTION_KEYS:
            key, value = OPTION_KEYS[part]
            overrides[key] = value
        else:
            parser.error(f"unknown option {part!r} in --options (gradient_checkpointing, compile, attn=NAME)")
    return overrides


def _fastest(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of a variant's repeats, with every repeat's tok/s and load averages beside it."""
    done = [record for record in measured if "tok_s" in record]
    if not done:
        return measured[0]
    best = max(done, key=lambda record: record["tok_s"])
    if len(measured) == 1:
        return best
    return best | {"repeats": len(measured), "tok_s_all": [record.get("tok_s") for record in measured],
                   "load_avg_all": [record["load_avg"] for record in measured]}


def _measured(record: dict[str, Any] | None) -> bool:
    return record is not None and "tok_s" in record


def _ratio(name: str, top: dict[str, Any], bottom: dict[str, Any]) -> dict[str, Any]:
    """tok/s of `top` over `bottom`, and peak memory of `bottom` over `top` (> 1: `top` needs less)."""
    return {"ratio": name, "value": round(top["tok_s"] / bottom["tok_s"], 3),
            "peak_ratio": round(bottom["peak_bytes"] / max(top["peak_bytes"], 1), 2),
            "peak_total_ratio": round(bottom["peak_total_bytes"] / max(top["peak_total_bytes"], 1), 2),
            "load_avg": [bottom["load_avg"][0], top["load_avg"][1]]}


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    head = {"variant": spec["label"], "batch": spec["config"]["student"]["batch_size"],
            "seq_len": spec["config"]["seq_len"]}
    command = [sys.executable, "-m", "kdflow.bench_train_step", "--measure", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    if done.returncode in (-9, 137):  # the kernel's OOM killer
        return head | {"error": "out of memory", "killed": True}
    last_line = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    return head | {"error": last_line}


# --- one measurement, in a fresh process --------------------------------------------------------------------


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kdflow.schemas.config import config_from_dict
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
            result = _measure_step(config, spec["variant"], spec["warmup"], spec["steps"], device)
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


def _first_batch(config: Any, tokenizer: Any) -> tuple[Any, str]:
    """The first training batch of the config's stores, else a synthetic one; -> (DistillBatch, source)."""
    from kdflow.schemas.errors import KDFlowError
    from kdflow.tasks.student.data import open_distill_data

    batch_size = config.student.batch_size
    try:
        data = open_distill_data(config, tokenizer)
        return data.train_batch(data.rank_rows(0, batch_size, 0, 1)), "stores"
    except KDFlowError as error:
        return _synthetic_batch(batch_size, config.seq_len, config.precompute.top_k, len(tokenizer)), \
            f"synthetic ({error})"


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


def _measure_step(config: Any, variant: str, warmup: int, steps: int, device: Any) -> dict[str, Any]:
    """(a) plain or (b) fused: the same batch every step, `warmup` steps, then `steps` timed ones."""
    import torch.nn.functional as F

    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.distributed import clip_grad_norm
    from kdflow.tasks.student.model import build_student
    from kdflow.tasks.student.options import apply_student_options
    from kdflow.tasks.student.train import (DistillLoss, autocast_for, build_optimizer, distill_loss,
                                            next_token_labels)

    student = config.student
    tokenizer = load_tokenizer(config)
    batch, source = _first_batch(config, tokenizer)
    batch = batch.to(device)
    model = apply_student_options(build_student(config, tokenizer).to(device), student, device)
    model.train()
    module = DistillLoss(model)
    optimizer, scheduler = build_optimizer(model, student)
    autocast = autocast_for(device, student.autocast_bf16)
    rows, seq_len = batch.input_ids.shape
    counts = (float(rows * seq_len), float(rows * (seq_len - 1)))
    labels = next_token_labels(batch.input_ids).flatten()  # (n * T,)

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
        _synchronise(device)
        warmup_s.append(round(time.perf_counter() - started, 3))
    _reset_peak(device)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = one_step()
        _synchronise(device)
        seconds.append(time.perf_counter() - started)
    peak_total = _peak_bytes(device)
    watch = _TensorPeak(device)
    watch.start()
    one_step()  # one more, for the tensor peak (the profiler slows it: not timed)
    return {"topk": source, "seconds": round(sum(seconds), 3), "step_s": sorted(round(s, 3) for s in seconds),
            "warmup_s": warmup_s, "loss": round(loss, 5), "peak_bytes": watch.stop(), "peak_total_bytes": int(peak_total),
            "options": _options_of(student)}


def _measure_stage(config: Any, warmup: int, steps: int, device: Any) -> dict[str, Any]:
    """(c) `train()` on the real shards with a scratch student; timed between the on_step calls of steps
    `warmup` and `warmup + steps`, so everything the loop does between two steps is inside."""
    from kdflow.schemas.layout import STUDENTS_DIR
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_stores
    from kdflow.tasks.student.jsonl_log import read_jsonl
    from kdflow.tasks.student.train import train

    name = f"bench-train-step-{os.getpid()}"
    total = warmup + steps + 1  # the last one for the tensor peak, under the profiler
    config = _with_overrides(config, {"student.name": name, "student.steps": total, "student.eval_every": 0,
                                      "student.save_every": total + 1, "student.eval_sequences": 1})
    open_stores(config, load_tokenizer(config))  # no stores at this seq_len: skipped, with the reason
    run_root = RunRoot(config.run_root)
    student_dir = run_root.path(STUDENTS_DIR, name)
    timed_end = warmup + steps
    marks: dict[int, tuple[float, int]] = {}
    watch = _TensorPeak(device)

    def on_step(record: dict[str, Any]) -> bool:
        _synchronise(device)
        if record["step"] == warmup:
            marks[warmup] = (time.perf_counter(), _reset_peak(device))
        elif record["step"] == timed_end:
            marks[timed_end] = (time.perf_counter(), _peak_bytes(device))
            watch.start()
        elif record["step"] == total:
            marks[total] = (0.0, watch.stop())
        return record["step"] >= total  # stop: no closing evaluation or final model

    try:
        train(config, on_step=on_step)
        metrics = read_jsonl(run_root, f"{student_dir}/metrics.jsonl")
    finally:
        if run_root.is_local:
            shutil.rmtree(student_dir, ignore_errors=True)
        elif run_root.exists(student_dir):
            run_root.fs.rm(student_dir, recursive=True)
    (start, _), (end, peak_total), (_, peak) = marks[warmup], marks[timed_end], marks[total]
    timed = [r for r in metrics if warmup < r["step"] <= timed_end]
    step_only = sum(r["tokens"] / r["tokens_per_s"] for r in timed)  # seconds inside StudentRun.step()
    return {"topk": "stores", "seconds": round(end - start, 3), "step_only_s": round(step_only, 3),
            "loss": round(timed[-1]["loss"], 5), "peak_bytes": peak, "peak_total_bytes": int(peak_total),
            "options": _options_of(config.student)}


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


if __name__ == "__main__":
    raise SystemExit(main())
