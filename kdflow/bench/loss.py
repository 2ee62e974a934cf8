"""`kdflow bench loss`: time and peak memory of the fused top-K KL loss against a dense one.

For every (vocab, hidden, tokens, mode) it prints one JSON object per line. Each measurement runs in a
fresh Python process, so that one measurement's allocations cannot hide in another's peak:
on CPU the peak is the growth of resident memory (VmHWM, reset before the step) over the resident
memory after the inputs were built; on CUDA it is torch.cuda.max_memory_allocated over the baseline.
"Dense" materialises the (N, V) logits and applies the same K+1 bucket KL with plain autograd; where it
runs, the same process also runs the fused loss on the same inputs and reports the agreement.
`--autocast-bf16` runs both under bf16 autocast (as the student's step does on CUDA); the agreement is then
the fused loss under autocast against the dense loss in float32 without it (the reference step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

from kdflow.bench.args import bench_parser
from kdflow.bench.harness import emit, peak_bytes, reset_peak, run_fresh, synchronise
from kdflow.tasks.common.units import GIB

# Dense peak over its (N, V) float32 logits, measured on CPU with this script (logits, log-softmax,
# the scattered copy for the tail, and their gradients): used to skip runs that would not fit.
DENSE_PEAK_PER_LOGITS = 5.5
MODULE = "kdflow.bench.loss"  # the child of each measurement: python -m MODULE --measure SPEC


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.modes or set(args.modes) - {"fused", "dense"}:
        parser.error(f"--modes must be a comma list of fused, dense; got {','.join(args.modes)}")
    if args.measure:
        emit(_measure(json.loads(args.measure)))
        return 0
    for record in records(args):
        emit(record)
    return 0


def records(args: argparse.Namespace) -> Iterator[dict]:
    """Each mode's record at every size, as it is measured (in a fresh process each); `args` from `_parser`."""
    dense_limit = min(args.dense_max_gib * GIB, 0.6 * _available_memory_bytes(args.device))
    for vocab, width, tokens in itertools.product(args.vocab, args.hidden, args.tokens):
        spec = {"tokens": tokens, "vocab": vocab, "hidden": width, "top_k": args.top_k,
                "chunk_tokens": args.chunk_tokens, "device": args.device, "repeats": args.repeats,
                "autocast_bf16": args.autocast_bf16}
        dense = None
        if "dense" in args.modes:
            estimate = DENSE_PEAK_PER_LOGITS * tokens * vocab * 4
            if estimate > dense_limit:
                # A planned skip, not an error: nothing was attempted (kdflow bench gpu counts it as skipped).
                dense = spec | {"mode": "dense", "estimated_peak_gib": round(estimate / GIB, 2),
                                "skipped": f"estimated peak {estimate / GIB:.1f} GiB over the limit "
                                           f"{dense_limit / GIB:.1f} GiB"}
            else:
                dense = _run_child(spec | {"mode": "dense", "compare_fused": "fused" in args.modes})
            yield dense
        if "fused" in args.modes:
            fused = _run_child(spec | {"mode": "fused"})
            if dense is not None and "loss_abs_diff" in dense:
                fused |= {key: dense[key] for key in ("loss_abs_diff", "grad_max_rel_diff")}
                peak_ratio = dense["peak_bytes"] / max(fused["peak_bytes"], 1)
                fused["peak_ratio_dense_over_fused"] = round(peak_ratio, 2)
                fused["time_ratio_fused_over_dense"] = round(fused["seconds"] / dense["seconds"], 3)
            yield fused


def build_parser() -> argparse.ArgumentParser:
    def int_list(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part]

    parser = bench_parser("loss", __doc__, device="cpu", devices=["cpu", "cuda"], top_k=128, repeats=2,
                          helps={"repeats": "timed steps per measurement (min is reported)"})
    parser.add_argument("--tokens", type=int_list, default=[2048, 8192, 32768], help="comma list of N")
    parser.add_argument("--vocab", type=int_list, default=[49152], help="comma list of V")
    parser.add_argument("--hidden", type=int_list, default=[576], help="comma list of H")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=["fused", "dense"])
    parser.add_argument("--chunk-tokens", type=int, default=4096)
    parser.add_argument("--dense-max-gib", type=float, default=12.0,
                        help="skip dense above this estimated peak")
    parser.add_argument("--autocast-bf16", action="store_true",
                        help="both modes under bf16 autocast; the agreement against a float32 dense reference")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one measurement, in a child process
    return parser


def _run_child(spec: dict) -> dict:
    done = run_fresh(MODULE, ["--measure", json.dumps(spec)])
    return done.record if done.ok else spec | done.failure()


def _measure(spec: dict) -> dict:
    """One measurement in this (fresh) process; returns the JSON record."""
    import torch

    from kdflow.tasks.student.losses import fused_topk_kl

    device = torch.device(spec["device"])
    inputs = _make_inputs(spec, device)
    record = {key: spec[key] for key in ("mode", "tokens", "vocab", "hidden", "top_k", "device")}
    autocast = bool(spec.get("autocast_bf16"))
    record["autocast_bf16"] = autocast
    if spec["mode"] == "fused":
        record["chunk_tokens"] = spec["chunk_tokens"]

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if spec["mode"] == "dense":
                return _dense_topk_kl(*inputs)
            return fused_topk_kl(*inputs, chunk_tokens=spec["chunk_tokens"])

    try:
        seconds, peak = [], 0
        for _ in range(spec["repeats"]):
            inputs[0].grad = inputs[1].grad = None
            baseline = reset_peak(device)
            start = time.perf_counter()
            loss = step()
            loss.backward()
            synchronise(device)
            seconds.append(time.perf_counter() - start)
            peak = max(peak, peak_bytes(device) - baseline)
    except torch.OutOfMemoryError:
        return record | {"error": "out of memory"}
    record |= {"seconds": round(min(seconds), 3), "seconds_all": [round(s, 3) for s in seconds],
               "peak_bytes": int(peak), "peak_gib": round(peak / GIB, 3), "loss": float(loss.detach())}
    if spec.get("compare_fused"):
        record |= _agreement(inputs, loss, spec["chunk_tokens"], autocast)
    return record


def _agreement(inputs: list, dense_loss, chunk_tokens: int, autocast: bool = False) -> dict:
    """Abs diff of the loss and max |grad diff| / max |dense grad| over hidden and weight. With `autocast`, the
    fused loss runs under bf16 autocast and the dense reference is recomputed in float32 without it."""
    import torch

    from kdflow.tasks.student.losses import fused_topk_kl

    if autocast:
        inputs[0].grad = inputs[1].grad = None
        dense_loss = _dense_topk_kl(*inputs)
        dense_loss.backward()
    dense_grads = [inputs[0].grad.clone(), inputs[1].grad.clone()]
    inputs[0].grad = inputs[1].grad = None
    with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16, enabled=autocast):
        fused_loss = fused_topk_kl(*inputs, chunk_tokens=chunk_tokens)
    fused_loss.backward()
    relative = [float((f.grad - d).abs().max() / d.abs().max()) for f, d in zip(inputs[:2], dense_grads)]
    return {"loss_abs_diff": abs(fused_loss.item() - dense_loss.item()), "grad_max_rel_diff": max(relative)}


def _make_inputs(spec: dict, device) -> list:
    """Student hidden/weight and a synthetic teacher top-K (int32 ids, float16 log-probs, tail 10%)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    rows, vocab, width, top_k = spec["tokens"], spec["vocab"], spec["hidden"], spec["top_k"]
    hidden = torch.randn(rows, width, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(vocab, width, generator=gen) / width**0.5).to(device).requires_grad_()
    # Distinct ids per row without an (N, V) tensor: a random start and a stride of V // K.
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    topk_ids = ((start + torch.arange(top_k) * (vocab // top_k)) % vocab).to(torch.int32)
    logprobs = torch.log_softmax(torch.randn(rows, top_k, generator=gen) * 2, dim=1) + math.log(0.9)
    topk_logprobs = logprobs.sort(dim=1, descending=True).values.half()
    return [hidden, weight, topk_ids.to(device), topk_logprobs.to(device)]


def _dense_topk_kl(hidden, weight, topk_ids, topk_logprobs):
    """The same K+1 bucket KL with the (N, V) logits materialised; plain autograd."""
    import torch

    ids, teacher_log_p = topk_ids.long(), topk_logprobs.float()
    log_q = torch.log_softmax(hidden @ weight.T, dim=1)  # (N, V)
    log_q_top = log_q.gather(1, ids)  # (N, K)
    log_q_tail = log_q.scatter(1, ids, float("-inf")).logsumexp(1)  # (N,)
    p = teacher_log_p.exp()
    p_tail = (1 - p.sum(1)).clamp_min(0)
    kd = (p * (teacher_log_p - log_q_top)).sum(1) + torch.xlogy(p_tail, p_tail) - p_tail * log_q_tail
    mass = p.sum(1) + p_tail  # the loss's - s log s term (docs/loss.md): 0 here but for rounding
    return (kd - torch.xlogy(mass, mass)).mean()


def _available_memory_bytes(device: str) -> float:
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return float(free)
    match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return float(match.group(1)) * 1024


if __name__ == "__main__":
    raise SystemExit(main())
