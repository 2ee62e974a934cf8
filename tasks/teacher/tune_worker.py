"""One micro-batch candidate in its own process: `python -m kdflow.tasks.teacher.tune_worker --config RESOLVED.yaml
--micro-batch N [--batches 3] [--warmup 1]`; with `--experts`, a MoE teacher's experts implementations timed
side by side at that micro-batch instead (`measure_experts`), with `--heads` both heads (`tune_heads`).
`--random-weights`: the teacher made from its config alone (kdflow.tasks.common.random_teacher); `--memory-gib
N`: the process held to what a card of N GiB would leave it (kdflow.tasks.common.device_memory), its headroom
judged against that card.

`kdflow tune precompute` and the `tune-precompute` flow start one per candidate, so that an out-of-memory
or a CUDA driver error ends that candidate only. It speaks the worker protocol (`kdflow.schemas.protocol`):
its measurement is the result line, a failure is an error line and the exit code of its kind (75 for CUDA
out of memory, 71 device not ready, ..., 2 for a bad config). It dies with its parent.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kdflow.tasks.common.worker import run_worker, run_worker_main

MODULE = "kdflow.tasks.teacher.tune_worker"


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved config (YAML)")
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--batches", type=int, default=3, help="timed micro-batches")
    parser.add_argument("--warmup", type=int, default=1, help="untimed micro-batches first")
    trial = parser.add_mutually_exclusive_group()
    trial.add_argument("--experts", action="store_true",
                       help="time the experts implementations at the micro-batch (--batches repeats each)")
    trial.add_argument("--heads", action="store_true", help="time both heads (precompute.head) at the micro-batch")
    parser.add_argument("--random-weights", action="store_true", help="the teacher from its config, random weights")
    parser.add_argument("--memory-gib", type=float, help="hold the CUDA device to a card of this many GiB")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as the pass runs: deterministic cuBLAS
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def body() -> dict[str, Any]:
        from transformers.utils import logging as transformers_logging

        from kdflow.schemas.config_io import load_config
        from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
        from kdflow.tasks.common.device_memory import cap_device_memory, capped_memory_record, check_capped_device
        from kdflow.tasks.teacher.tune_heads import measure_heads
        from kdflow.tasks.teacher.tune_trial import measure_candidate, measure_experts

        transformers_logging.disable_progress_bar()
        config = load_config(args.config)
        run_root, settings = open_run_root(config), teacher_pass_settings(config)
        random = {"random_weights": args.random_weights}
        cap = None
        if args.memory_gib is not None:
            cap = cap_device_memory(check_capped_device(config.teacher.device, args.memory_gib), args.memory_gib)
        if args.experts:
            return measure_experts(run_root, settings, args.micro_batch, args.batches, **random) | {"pid": os.getpid()}
        if args.heads:
            return measure_heads(run_root, settings, args.micro_batch, args.batches, args.warmup,
                                 **random) | {"pid": os.getpid()}
        record = measure_candidate(run_root, settings, args.micro_batch, args.batches, args.warmup, **random)
        return (capped_memory_record(record, cap) if cap else record) | {"pid": os.getpid()}

    what = "experts" if args.experts else "heads" if args.heads else "micro-batch"
    return run_worker(body, label=f"kdflow tune worker ({what} {args.micro_batch})")


if __name__ == "__main__":
    run_worker_main(run)
