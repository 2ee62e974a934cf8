"""`kdflow bench head`: the teacher's head (lm_head, log-sum-exp, top-K and tail over the whole vocabulary) per
token, each way the pass can take it, against the bare lm_head matmul of the same shapes.

Variants: `matmul` (the matmul alone, into the logits buffer: the floor), `slab` (today's slab loop,
kdflow.tasks.teacher.topk.chunked_topk), `tiled` (the tiled top-K, kdflow.tasks.teacher.tiled_topk, with its tile
statistics in torch), `tiled-triton` (the same with the Triton tile kernel) and `tiled-gemm` (the statistics made
by a Triton lm_head GEMM as it writes the logits, kdflow.tasks.teacher.head_gemm); then the same for hybrid targets
(`--sampling H,S`, an exact top-H and S sampled tokens): `sampled-slab` (the slab loop's sampler,
kdflow.tasks.teacher.sampling), `sampled-tiled`, `sampled-tiled-triton` and `sampled-tiled-gemm` (the tiled
sampler, kdflow.tasks.teacher.sampled_tiles). The Triton variants are timed on CUDA only, skipped elsewhere
(`--interpret`: run through Triton's interpreter on a CPU, for their values).
One JSON line per (shape, variant): microseconds per token (the best of `--repeats` after a warm-up), the ratio to
the matmul, and the largest difference of its log-probs from its slab loop's with the share of ids it agrees on.
Random hidden states and weights: the speed does not depend on what the numbers mean.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kdflow.bench.args import bench_parser, tilings_option
from kdflow.bench.harness import emit, note, synchronise

VARIANTS = ("matmul", "slab", "tiled", "tiled-triton", "tiled-gemm", "sampled-slab", "sampled-tiled",
            "sampled-tiled-triton", "sampled-tiled-gemm")
TRITON_VARIANTS = ("tiled-triton", "tiled-gemm", "sampled-tiled-triton", "sampled-tiled-gemm")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for record in records(args):
        emit(record)
    return 0


def build_parser() -> argparse.ArgumentParser:
    def int_list(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part]

    parser = bench_parser("head", __doc__, device="cpu", devices=["cpu", "cuda"], top_k=128, repeats=3,
                          helps={"repeats": "timed runs per variant after one warm-up (the best is reported)"})
    parser.add_argument("--vocab", type=int_list, default=[32768], help="vocabulary sizes (comma list)")
    parser.add_argument("--hidden", type=int_list, default=[512], help="hidden sizes (comma list)")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of hidden states")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="rows per block (the pass's chunk_tokens)")
    parser.add_argument("--tile", type=int, default=128, help="ids per tile of the tiled variants")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="weights and logits (default: bfloat16 on CUDA, float32 on CPU where bf16 is slower)")
    parser.add_argument("--logits", choices=["float32", "weight"], default="float32",
                        help="the logits' dtype: float32 (teacher.lm_head_float32, the pass's default: a 16-bit "
                             "weight's matmul with float32 output) or the weight's own")
    parser.add_argument("--sampling", type=int_list, default=[16, 12],
                        help="H,S of the sampled variants' hybrid targets (precompute.sampling's defaults)")
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(VARIANTS),
                        help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--interpret", action="store_true",
                        help="on a CPU under TRITON_INTERPRET=1, run the Triton variants through Triton's interpreter "
                             "(their values against the slab loop's; slow, and their times mean nothing)")
    parser.add_argument("--gemm-tiles", type=tilings_option, default=[],
                        help="more tilings of the tiled-gemm variant's GEMM to time beside the device's (top-K; the "
                             "sampler's runs the device's), a comma list of BMxBNxBK:STAGES:WARPS (128x256x64:3:8)")
    return parser


def records(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from kdflow.tasks.teacher.head_gemm import device_tiles
    from kdflow.tasks.teacher.sampled_step import tiled_head_sample
    from kdflow.tasks.teacher.sampling import SamplingPlan, chunked_sampled
    from kdflow.tasks.teacher.tile_stats_kernel import interpreting, triton_available
    from kdflow.tasks.common.float32_logits import Float32Logits
    from kdflow.tasks.teacher.tiled_topk import logit_blocks, tiled_head_topk
    from kdflow.tasks.teacher.tune_heads import agreement, sampled_fields
    from kdflow.tasks.teacher.topk import chunked_topk

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"kdflow bench head: unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    for vocab, width in itertools.product(args.vocab, args.hidden):
        float32 = args.logits == "float32" and dtype != torch.float32
        shape = {"vocab": vocab, "hidden": width, "tokens": args.tokens, "top_k": args.top_k,
                 "chunk_tokens": args.chunk_tokens, "tile": args.tile, "dtype": str(dtype).removeprefix("torch."),
                 "logits": "float32" if float32 else str(dtype).removeprefix("torch."), "device": str(device)}
        note({"bench": "head", **shape, "note": "shape"})
        generator = torch.Generator(device="cpu").manual_seed(0)
        hidden = torch.randn(args.tokens, width, generator=generator).to(device, dtype)
        weight = (torch.randn(vocab, width, generator=generator) / width**0.5).to(device, dtype)
        head: Any = weight  # the slab loop's lm_head: the weight, or the pass's float32-logits wrapper of it
        if float32:
            linear = torch.nn.Linear(width, vocab, bias=False, device=device, dtype=dtype)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            head = Float32Logits(linear)

        def matmul() -> None:  # the pass's matmul alone, block by block into its logits buffer
            for _ in logit_blocks(hidden, weight, args.chunk_tokens, float32):
                pass

        plan = SamplingPlan(head=args.sampling[0], samples=args.sampling[1])
        where = {"shard": 0, "rows": torch.arange(args.tokens, device=device) // 512,
                 "positions": torch.arange(args.tokens, device=device) % 512}

        def run_of(variant: str, tiling: Any) -> Callable[[], Any]:
            """The variant's call; `tiling`: the GEMM's tiles for the tiled-gemm ones."""
            if variant == "matmul":
                return matmul
            if variant == "slab":
                return lambda: chunked_topk(hidden, head, args.top_k, args.chunk_tokens, return_tail=True)
            if variant == "sampled-slab":
                return lambda: sampled_fields(chunked_sampled(hidden, head, plan, args.chunk_tokens, **where))
            if variant.startswith("sampled-"):
                return lambda: sampled_fields(tiled_head_sample(
                    hidden, weight, plan, args.chunk_tokens, tile=args.tile, variant=variant.removeprefix("sampled-"),
                    float32=float32, gemm_tiling=tiling, **where))
            return lambda: tiled_head_topk(hidden, weight, args.top_k, args.chunk_tokens, tile=args.tile,
                                           float32=float32, variant=variant, gemm_tiling=tiling)

        references, floor = {}, None
        interpreted = args.interpret and interpreting() and device.type == "cpu"  # values, not speed
        for variant in [name for name in VARIANTS if name in args.variants]:
            record = {"bench": "head", "variant": variant, **shape}
            if variant.startswith("sampled-"):
                record["sampling"] = {"head": plan.head, "samples": plan.samples, "hash_version": plan.hash_version}
            if variant in TRITON_VARIANTS and not (triton_available() and (device.type == "cuda" or interpreted)):
                yield record | {"skipped": "the Triton kernel is timed on CUDA with Triton installed"}
                continue
            tilings: list[Any] = [None]
            if variant.endswith("tiled-gemm"):  # the device's tiling, then (top-K) each one asked for
                extra = args.gemm_tiles if variant == "tiled-gemm" else []
                tilings = [device_tiles(device, dtype, args.tile), *extra]
            for tiling in tilings:
                timed = record | ({"gemm_tiles": str(tiling)} if tiling else {})
                seconds, result = _best_of(run_of(variant, tiling), args.repeats, device)
                timed["us_per_token"] = round(seconds / args.tokens * 1e6, 4)
                if variant == "matmul":
                    floor = seconds
                elif floor is not None:
                    timed["over_matmul"] = round(seconds / floor, 3)
                kind = "sampled" if variant.startswith("sampled-") else "topk"
                if variant in ("slab", "sampled-slab"):
                    references[kind] = result
                elif kind in references and result is not None:
                    timed |= agreement(references[kind], result)
                yield timed


def _best_of(run: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, Any]:
    result = run()  # warm-up: kernels compiled, buffers allocated
    synchronise(device)
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        result = run()
        synchronise(device)
        best = min(best, time.perf_counter() - start)
    return best, result
