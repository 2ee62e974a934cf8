"""The teacher worker process: `python -m kdflow.tasks.teacher.precompute_worker --config RESOLVED.yaml
[--shards 0,3,5-9]`.

One process per attempt: it loads the teacher once, computes every uncommitted shard it was given, and
exits with a code of the worker protocol (`kdflow.schemas.protocol`: 0 done, 2 user error, distinct
retryable codes for CUDA driver failures), so a CUDA context broken by a driver reset dies with its
process and the retry starts clean. Its stdout carries the protocol's progress, result and error lines
for the flow; everything else is free text for the run log. It dies with its parent (the flow).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from kdflow.schemas.protocol import PROGRESS_PREFIX, emit, parse_shard_ids
from kdflow.tasks.common.worker import configure_logging, run_worker, run_worker_main

MODULE = "kdflow.tasks.teacher.precompute_worker"


def run(argv: list[str] | None = None) -> int:
    """Everything the worker does; returns its exit code (never raises)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved config (YAML)")
    parser.add_argument("--shards", default=None, help="shard ids: 0,3,5 or 3-9 (default: all)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="run at this many sequences a forward (the flow's, after an out-of-memory)")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)
    # cuBLAS needs this before its first call to be deterministic.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_root: list[str] = []

    def body() -> dict[str, Any]:
        from transformers.utils import logging as transformers_logging

        from kdflow.schemas.config_io import load_config
        from kdflow.schemas.errors import ConfigError
        from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
        from kdflow.tasks.teacher.precompute import precompute_shards

        transformers_logging.disable_progress_bar()  # weight-loading bars are noise in the flow's run log
        config = load_config(args.config)
        run_root.append(config.run_root)
        try:
            shard_ids = parse_shard_ids(args.shards)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if args.micro_batch is not None and args.micro_batch < 1:
            raise ConfigError(f"--micro-batch {args.micro_batch}: a micro-batch holds at least 1 sequence")
        summary = precompute_shards(open_run_root(config), teacher_pass_settings(config), shard_ids,
                                    on_progress=lambda update: emit(PROGRESS_PREFIX, update),
                                    micro_batch=args.micro_batch)
        return summary | {"pid": os.getpid()}

    return run_worker(body, label="kdflow worker", writes_under=lambda: run_root[0] if run_root else None)


if __name__ == "__main__":
    run_worker_main(run)
