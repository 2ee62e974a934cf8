"""`kdflow tune precompute CONFIG.yaml`: the teacher's fastest micro-batch that fits, measured on this machine.

Each candidate loads the configured teacher in a fresh process and times a few real micro-batches
(`kdflow.tasks.teacher.tune_search`); the table shows tok/s, peak memory and headroom, and the recommendation is the
fastest candidate that leaves `--headroom` of the memory free. At that micro-batch one more process then times
both heads of the pass (`slab`, `tiled`: Triton kernels on CUDA) and recommends the faster whose targets match the
slab loop's, and for a MoE teacher another its experts implementations (`grouped_mm`, `batched_mm`, `eager`,
`kdflow_fused` where Triton and CUDA are there; inside the compiled body where `precompute.compile_body` is on),
recommending the fastest whose hidden states match eager's.
`--write` puts them into CONFIG.yaml (`precompute.micro_batch`, `precompute.head`, `precompute.experts`), editing
those values in place (comments and layout kept), so that the run uses them from its first shard to its last. The
checks and the edit are `kdflow.tasks.teacher.tune_file`'s; this module parses the options and prints.

Before the weights are here, or for a card smaller than this one: `--random-weights` makes the teacher from its
config alone (its folder needs config.json and the tokenizer, no weight files), and `--memory-gib 24` holds each
candidate to what a 24 GiB card would leave it, so `kdflow tune precompute configs/llmjp.yaml --random-weights
--memory-gib 24` on any large GPU says what a 24 GB card fits. A MoE's random router spreads tokens over the
experts more evenly than a trained one: the memory is the shapes', the speed may differ somewhat.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kdflow.schemas.config_io import parse_override
from kdflow.schemas.errors import first_paragraph


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdflow tune precompute", description=first_paragraph(__doc__))
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("--micro-batches", help="comma list of candidates (default: half, 1x, 2x and 4x the config's)")
    parser.add_argument("--headroom", type=float, default=0.10,
                        help="fraction of the device's memory (CPU: the machine's) left free at the peak "
                             "(default 0.10)")
    parser.add_argument("--batches", type=int, default=3, help="timed micro-batches per candidate (after one warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed micro-batches per candidate first")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="a candidate's process is killed after this")
    parser.add_argument("--keep-going", action="store_true", help="try larger candidates after an out-of-memory too")
    parser.add_argument("--write", action="store_true",
                        help="write the recommendations into CONFIG: precompute.micro_batch, precompute.head and "
                             "(a MoE teacher) precompute.experts")
    parser.add_argument("--skip-heads", action="store_true", help="do not time the two heads")
    parser.add_argument("--skip-experts", action="store_true",
                        help="do not time a MoE teacher's experts implementations")
    parser.add_argument("--random-weights", action="store_true",
                        help="make the teacher from its config alone, with random weights (its folder needs no weight "
                             "files): what fits and how fast depend on its shapes, not its values")
    parser.add_argument("--memory-gib", type=float,
                        help="tune for a card of this many GiB on a larger CUDA device (each candidate's process is "
                             "held to what that card would leave it; headroom is judged against it)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line after the table")
    parser.add_argument("--verbose", action="store_true", help="show the candidates' own log lines (stderr)")
    parser.add_argument("--set", action="append", default=[], type=parse_override, metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from kdflow.tasks.common.launch import config_file
    from kdflow.tasks.common.models import resolve_device
    from kdflow.tasks.teacher import tune_search
    from kdflow.tasks.teacher.tune_file import check_tune_request, write_micro_batch, write_precompute_setting

    request = check_tune_request(args.config, dict(args.set),
                                 micro_batches=args.micro_batches, headroom=args.headroom, batches=args.batches,
                                 warmup=args.warmup, timeout_s=args.timeout_s, write=args.write,
                                 random_weights=args.random_weights)
    config, sizes = request.config, request.sizes
    worker_args = tune_search.worker_options(config.teacher.device, args.random_weights, args.memory_gib)
    device = resolve_device(config.teacher.device)
    on = f"{device} ({config.teacher.device})" if config.teacher.device == "auto" else str(device)
    pre = config.precompute
    head = f"head {pre.sampling.head}, " if pre.targets == "hybrid" else ""
    targets = (f"top_k {pre.top_k}" if pre.targets == "topk"
               else f"{pre.targets} targets ({head}{pre.sampling.samples} samples)")
    held = f" held to a {args.memory_gib:g} GiB card" if args.memory_gib is not None else ""
    weights = " (random weights)" if args.random_weights else ""
    print(f"kdflow tune precompute: {config.teacher.model}{weights} on {on}{held}, seq_len {config.seq_len}, "
          f"{targets}; candidates {','.join(map(str, sizes))}; rows: {request.rows_from}", flush=True)

    def report(candidate: tune_search.Candidate) -> None:
        if candidate.status == "ok":
            detail = f"{candidate.tokens_per_s:,.0f} tok/s, headroom {candidate.record['headroom']:.1%}"
        else:
            detail = candidate.message
        print(f"  micro-batch {candidate.micro_batch}: {candidate.status}: {detail}", flush=True)

    with config_file(config, "kdflow-tune-") as path:
        candidates = tune_search.tune(path, sizes, batches=args.batches, warmup=args.warmup,
                                      timeout_s=args.timeout_s, keep_going=args.keep_going, on_candidate=report,
                                      on_log=_worker_log if args.verbose else _quiet, worker_args=worker_args)
    print()
    print(tune_search.table(candidates, args.headroom))
    result = tune_search.summary(candidates, args.headroom)
    chosen = result["recommended_micro_batch"]
    if chosen is None:
        print(f"\nno candidate ran with {args.headroom:.0%} headroom; try smaller micro-batches or "
              "teacher.load_in_4bit")
    else:
        print(f"\nrecommended: precompute.micro_batch: {chosen} ({result['recommended_tokens_per_s']:,.0f} tok/s, "
              f"{result['recommended_over_fastest']:.1%} of the fastest candidate)")
        trials = [(kind, describe) for kind, describe, wanted in (
            ("heads", tune_search.heads_report, not args.skip_heads),
            ("experts", tune_search.experts_report, request.experts and not args.skip_experts)) if wanted]
        with config_file(config, "kdflow-tune-") as path:
            for kind, describe in trials:
                print(f"\ntiming the {kind} at micro-batch {chosen} (a fresh process: the teacher loads again)",
                      flush=True)
                result[kind] = tune_search.run_trial(kind, path, chosen, repeats=args.batches,
                                                     timeout_s=args.timeout_s,
                                                     on_log=_worker_log if args.verbose else _quiet,
                                                     worker_args=worker_args)
                print(describe(result[kind], getattr(config.precompute, tune_search.TRIALS[kind].setting)),
                      flush=True)
        if args.write:
            write_micro_batch(Path(args.config), chosen)
            for kind, _ in trials:
                trial = tune_search.TRIALS[kind]
                if result[kind].get(trial.recommended) is not None:
                    write_precompute_setting(Path(args.config), trial.setting, result[kind][trial.recommended])
            print(f"written to {args.config}")
    if args.json:
        print(json.dumps({"tune": "precompute", **result}))
    return 0 if chosen is not None else 1


def _worker_log(line: str) -> None:
    print(f"    | {line}", file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    pass
