"""`kdflow bench precompute`: the teacher pass's top-K step, chunked against dense.

Measures only the top-K step (lm_head matmul, log-sum-exp over the full vocabulary, top-K): both modes
get the same random lm_head weight and the same random hidden states, and the model body is not run.
Dense materialises `(micro_batch * seq_len, vocab)` logits, then log_softmax and topk; chunked is
`kdflow.tasks.teacher.topk.chunked_topk` (on CPU by default with vocabulary slabs, see `resolve_defaults`).
Prints one JSON object per line per (micro-batch, mode).

On CPU each measurement runs in a fresh subprocess, so its peak RSS growth belongs to that measurement
alone; on CUDA the allocator's peak statistics are used in-process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from kdflow.bench.args import bench_parser
from kdflow.bench.harness import PeakMemory, emit, run_fresh
from kdflow.tasks.common.units import GIB
from kdflow.tasks.teacher.topk import choose_chunk_tokens, chunked_topk

MEASURED = (
    "top-K step only (lm_head matmul + full-vocabulary log-sum-exp + top-K); both modes get the same random "
    "lm_head weight and hidden states; the model body is not run"
)
MODULE = "kdflow.bench.precompute"  # the child of each CPU measurement (--worker-mode ...)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("precompute", __doc__, device="auto", devices=["auto", "cpu", "cuda"], seq_len=None,
                          top_k=128, repeats=3, seed=0, threads=True,
                          helps={"seq_len": "tokens per sequence (default: 512 on cuda, 64 on cpu)",
                                 "repeats": "timed runs per measurement (median reported)"})
    parser.add_argument("--vocab", type=int, default=196_608)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--micro-batches", default="14,28,56", help="comma-separated micro-batch sizes")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: from --chunk-budget-mib")
    parser.add_argument(
        "--vocab-chunk", type=int, default=None, help="vocabulary slab; 0 = whole vocabulary (default cuda), 49152 cpu"
    )
    parser.add_argument(
        "--chunk-budget-mib", type=int, default=None, help="memory for one chunk's logits; default 1024 cuda, 512 cpu"
    )
    parser.add_argument("--dense-limit-gib", type=float, default=None, help="skip dense runs estimated above this")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first; default 1 cuda, 0 cpu")
    # Internal: one CPU measurement in a fresh process.
    parser.add_argument("--worker-mode", choices=["chunked", "dense"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-micro-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the device-dependent defaults so that workers and the parent agree on every value."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    on_cuda = args.device == "cuda"
    args.seq_len = args.seq_len or (512 if on_cuda else 64)
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    # Each row chunk streams the whole lm_head weight from memory once. On this CPU that made 320-row chunks
    # ~15% slower than dense; vocabulary slabs let a chunk hold ~1300 rows in the same memory. A GPU's
    # bandwidth makes whole-vocabulary chunks of a few hundred rows compute-bound already.
    args.vocab_chunk = args.vocab_chunk if args.vocab_chunk is not None else (0 if on_cuda else 49_152)
    budget_mib = args.chunk_budget_mib or (1024 if on_cuda else 512)
    # A fresh CPU process has nothing to warm up that a timed run would not redo (page faults, MKL init).
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cuda else 0)
    slab_width = min(args.vocab_chunk or args.vocab, args.vocab)
    args.chunk_tokens = args.chunk_tokens or choose_chunk_tokens(slab_width, budget_mib << 20)
    if args.dense_limit_gib is None:
        # This CPU machine is shared: keep any one dense run small. On a GPU, leave 10% headroom.
        args.dense_limit_gib = torch.cuda.mem_get_info()[0] * 0.9 / GIB if on_cuda else 10.0
    return args


def make_inputs(args: argparse.Namespace, micro_batch: int) -> tuple[Tensor, Tensor]:
    """Same seeds in every process: hidden (N, H) and lm_head weight (V, H) in the benchmark dtype."""
    dtype, device = _DTYPES[args.dtype], torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    # Weight std chosen so logits have std ~2.5: a peaked, teacher-like distribution.
    weight = torch.randn(args.vocab, args.hidden, generator=generator, device=device)
    weight = weight.mul_(2.5 / args.hidden**0.5).to(dtype)
    hidden = torch.randn(micro_batch * args.seq_len, args.hidden, generator=generator, device=device).to(dtype)
    return hidden, weight


def dense_topk(hidden: Tensor, weight: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The plain way: all logits (N, V), log_softmax, topk."""
    with torch.inference_mode():
        logits = (hidden @ weight.t()).float()  # (N, V)
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        return top.indices.int(), top.values


def dense_bytes(n_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Logits in the compute dtype (if not float32), their float32 copy, and the log_softmax output."""
    low_precision_bytes = 0 if dtype == torch.float32 else torch.finfo(dtype).bits // 8
    return n_tokens * vocab * (low_precision_bytes + 4 + 4)


def time_runs(
    step: Callable[[], tuple[Tensor, Tensor]], warmup: int, repeats: int, device: str
) -> tuple[float, float, tuple[Tensor, Tensor]]:
    """Median wall seconds and median process CPU seconds over `repeats` timed calls, and the last result.

    CPU seconds matter on a shared CPU machine: wall time there mostly measures the other tenants.
    """
    result = None
    for _ in range(warmup):
        result = step()
    wall_seconds, cpu_seconds = [], []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        result = step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_seconds.append(time.perf_counter() - wall_start)
        cpu_seconds.append(time.process_time() - cpu_start)
    return statistics.median(wall_seconds), statistics.median(cpu_seconds), result


def base_record(args: argparse.Namespace, mode: str, micro_batch: int) -> dict:
    return {
        "bench": "precompute_topk",
        "mode": mode,
        "device": args.device,
        "dtype": args.dtype,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "seq_len": args.seq_len,
        "micro_batch": micro_batch,
        "tokens": micro_batch * args.seq_len,
        "top_k": args.top_k,
        "threads": torch.get_num_threads(),
        "chunk_tokens": args.chunk_tokens if mode == "chunked" else None,
        "vocab_chunk": (args.vocab_chunk or args.vocab) if mode == "chunked" else None,
    }


def dense_skip_status(args: argparse.Namespace, micro_batch: int) -> str | None:
    """Why a dense run is not attempted (its estimated logits exceed the limit), or None to run it."""
    needed = dense_bytes(micro_batch * args.seq_len, args.vocab, _DTYPES[args.dtype])
    if needed <= args.dense_limit_gib * GIB:
        return None
    return f"skipped: would need {needed / GIB:.3g} GiB (limit {args.dense_limit_gib:.3g})"


def measure(args: argparse.Namespace, mode: str, micro_batch: int) -> tuple[dict, tuple[Tensor, Tensor] | None]:
    """One (mode, micro-batch) measurement in this process: its record and its top-K result."""
    record = base_record(args, mode, micro_batch)
    skip_status = dense_skip_status(args, micro_batch) if mode == "dense" else None
    if skip_status is not None:
        record["status"] = skip_status
        return record, None
    hidden, weight = make_inputs(args, micro_batch)
    if mode == "dense":
        step = partial(dense_topk, hidden, weight, args.top_k)
    else:
        vocab_chunk = args.vocab_chunk or None
        step = partial(chunked_topk, hidden, weight, args.top_k, args.chunk_tokens, vocab_chunk=vocab_chunk)
    peak = PeakMemory(args.device)
    seconds, cpu_seconds, result = time_runs(step, args.warmup, args.repeats, args.device)
    record.update(
        status="ok",
        seconds=round(seconds, 4),
        tokens_per_s=round(record["tokens"] / seconds, 1),
        cpu_seconds=round(cpu_seconds, 4) if args.device == "cpu" else None,
        peak_memory_gib=round(peak.growth_bytes() / GIB, 4),
        peak_memory_method=peak.method,
    )
    return record, (result[0].cpu(), result[1].cpu())


def measure_in_subprocess(
    args: argparse.Namespace, mode: str, micro_batch: int, out_dir: Path
) -> tuple[dict, tuple[Tensor, Tensor] | None]:
    """Run `measure` in a fresh Python process (clean RSS high-water mark); returns record and result."""
    skip_status = dense_skip_status(args, micro_batch) if mode == "dense" else None
    if skip_status is not None:  # no process needed to say so
        return {**base_record(args, mode, micro_batch), "status": skip_status}, None
    out_path = out_dir / f"{mode}-{micro_batch}.pt"
    worker = ["--worker-mode", mode, "--worker-micro-batch", str(micro_batch), "--worker-out", str(out_path)]
    done = run_fresh(MODULE, [*_worker_argv(args), *worker])
    if not done.ok:
        record = base_record(args, mode, micro_batch)
        record["status"] = f"error: worker exited {done.returncode}: {done.stderr_tail or 'no output'}"
        return record, None
    record = done.record
    result = torch.load(out_path) if out_path.exists() else None
    return record, result


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """Every resolved option, spelled out, so the worker cannot resolve a default differently."""
    return [
        f"--vocab={args.vocab}", f"--hidden={args.hidden}", f"--seq-len={args.seq_len}",
        f"--top-k={args.top_k}", f"--device={args.device}", f"--dtype={args.dtype}",
        f"--chunk-tokens={args.chunk_tokens}", f"--vocab-chunk={args.vocab_chunk}",
        f"--dense-limit-gib={args.dense_limit_gib}",
        f"--repeats={args.repeats}", f"--warmup={args.warmup}", f"--seed={args.seed}", f"--threads={args.threads}",
    ]  # fmt: skip


def run_worker(args: argparse.Namespace) -> int:
    record, result = measure(args, args.worker_mode, args.worker_micro_batch)
    if result is not None:
        torch.save(result, args.worker_out)
    emit(record)
    return 0


def agreement(chunked: tuple[Tensor, Tensor], dense: tuple[Tensor, Tensor]) -> dict:
    """How closely chunked reproduces dense: same ids at the same rank, and the largest logprob gap."""
    chunked_ids, chunked_logprobs = chunked
    dense_ids, dense_logprobs = dense
    return {
        "ids_agreement": round((chunked_ids == dense_ids).float().mean().item(), 6),
        "max_abs_logprob_diff": (chunked_logprobs - dense_logprobs).abs().max().item(),
    }


def compare(
    chunked_record: dict,
    dense_record: dict,
    chunked: tuple[Tensor, Tensor] | None,
    dense: tuple[Tensor, Tensor] | None,
) -> None:
    """Add the chunked-versus-dense fields to the chunked record, where both ran."""
    if chunked is None or dense is None:
        return
    chunked_record.update(agreement(chunked, dense))
    chunked_record["speed_vs_dense"] = round(chunked_record["tokens_per_s"] / dense_record["tokens_per_s"], 3)
    if chunked_record["cpu_seconds"] is not None:
        speed = dense_record["cpu_seconds"] / chunked_record["cpu_seconds"]
        chunked_record["speed_vs_dense_by_cpu_time"] = round(speed, 3)
    chunked_peak = max(chunked_record["peak_memory_gib"], 1e-6)
    chunked_record["dense_memory_over_chunked"] = round(dense_record["peak_memory_gib"] / chunked_peak, 2)


def main(argv: list[str] | None = None) -> int:
    args = prepare(build_parser().parse_args(argv))
    if args.worker_mode is not None:
        return run_worker(args)
    for record in records(args):
        emit(record)
    return 0


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """The options checked, the device's defaults filled in, torch's threads set: -> `args` for `records`."""
    args = resolve_defaults(args)
    if args.vocab_chunk < 0:
        raise SystemExit(f"--vocab-chunk must be >= 0, got {args.vocab_chunk}")
    for name in ("vocab", "hidden", "seq_len", "top_k", "chunk_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.top_k > args.vocab:
        raise SystemExit(f"--top-k must be <= --vocab ({args.vocab}), got {args.top_k}")
    if args.threads > 0:  # one thread makes CPU timings robust to other tenants (no parallel-region waits)
        torch.set_num_threads(args.threads)
    return args


def records(args: argparse.Namespace) -> Iterator[dict]:
    """Both modes' records for each micro-batch, chunked with its agreement to dense; `args` from `prepare`."""
    micro_batches = [int(size) for size in args.micro_batches.split(",") if size.strip()]
    with tempfile.TemporaryDirectory(prefix="kdflow-bench-") as out_dir:
        for micro_batch in micro_batches:
            results, measured = {}, {}
            for mode in ("chunked", "dense"):
                if args.device == "cpu":
                    measured[mode], results[mode] = measure_in_subprocess(args, mode, micro_batch, Path(out_dir))
                else:
                    measured[mode], results[mode] = measure(args, mode, micro_batch)
                    torch.cuda.empty_cache()
            compare(measured["chunked"], measured["dense"], results["chunked"], results["dense"])
            for mode in ("chunked", "dense"):
                measured[mode].update(loadavg_1m=round(os.getloadavg()[0], 2), measured=MEASURED)
                yield measured[mode]


if __name__ == "__main__":
    raise SystemExit(main())
