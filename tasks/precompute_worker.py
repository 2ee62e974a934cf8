"""The teacher worker process: `python -m tasks.precompute_worker --config RESOLVED.yaml [--shards 0,3,5-9]`.

One process per attempt: it loads the teacher once, computes every uncommitted shard it was given, and
exits with a code from `tasks.gpu_errors` (0 done, 2 user error, distinct retryable codes for CUDA driver
failures), so a CUDA context broken by a driver reset dies with its process and the retry starts clean.
Stdout carries machine-readable lines for the parent, everything else is free text for its log:
    KDFLOW_PROGRESS {...}   progress (stage, done, total, tokens, tokens_per_s, eta_s, ...)
    KDFLOW_RESULT {...}     the summary of `precompute_shards`, once, on success
    KDFLOW_ERROR {...}      exit_code, kind, type and a one-line message, once, on failure
The worker asks the kernel to SIGKILL it when its parent dies (Linux PR_SET_PDEATHSIG), so killing the
flow process never leaves a teacher holding the GPU. Stdlib imports only at the top: the flow imports the
helpers below without loading torch.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import traceback
from typing import Any

PROGRESS_PREFIX = "KDFLOW_PROGRESS "
RESULT_PREFIX = "KDFLOW_RESULT "
ERROR_PREFIX = "KDFLOW_ERROR "
PARENT_PID_ENV = "KDFLOW_PARENT_PID"
LEASE_OWNER_ENV = "KDFLOW_LEASE_OWNER"  # the flow passes one owner to every retry, so a retry takes over its lease
_PR_SET_PDEATHSIG = 1


def parse_shard_ids(text: str | None) -> list[int] | None:
    """'0,3,5' or '3-9' (inclusive) or a mix -> sorted ids; None or '' -> None (every shard)."""
    if not text:
        return None
    ids: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"--shards: expected ids like 0,3,5 or 3-9, got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"--shards: empty range {part!r}")
        ids.update(range(low, high + 1))
    return sorted(ids)


def format_shard_ids(ids: list[int]) -> str:
    """The inverse of parse_shard_ids, with runs collapsed: [0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    start = previous = None
    for shard_id in [*ordered, None]:
        if previous is not None and shard_id == previous + 1:
            previous = shard_id
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = shard_id
    return ",".join(parts)


def set_parent_death_signal() -> None:
    """SIGKILL this process when the parent dies (Linux only; elsewhere the parent kills the process group)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and int(expected) != os.getppid():
        os._exit(128 + int(signal.SIGKILL))  # the parent died before prctl took effect


def emit(prefix: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(prefix + json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def run(argv: list[str] | None = None) -> int:
    """Everything the worker does; returns its exit code (never raises)."""
    from tasks.gpu_errors import EXIT_CODE_NAMES, EXIT_NO_SPACE, EXIT_OK, EXIT_USER_ERROR, exit_code_for

    parser = argparse.ArgumentParser(prog="python -m tasks.precompute_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved config (YAML)")
    parser.add_argument("--shards", default=None, help="shard ids: 0,3,5 or 3-9 (default: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # cuBLAS needs this before its first call to be deterministic.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_root = None
    try:
        from transformers.utils import logging as transformers_logging

        from kdflow.config import load_config
        from kdflow.errors import ConfigError
        from tasks.precompute import precompute_shards

        transformers_logging.disable_progress_bar()  # weight-loading bars are noise in the flow's run log

        config = load_config(args.config)
        run_root = config.run_root
        try:
            shard_ids = parse_shard_ids(args.shards)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        summary = precompute_shards(config, shard_ids, on_progress=lambda update: emit(PROGRESS_PREFIX, update))
        emit(RESULT_PREFIX, summary | {"pid": os.getpid()})
        return EXIT_OK
    except BaseException as error:  # noqa: BLE001 - every failure must become an exit code
        code = exit_code_for(error)
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if code == EXIT_NO_SPACE and run_root:  # a failed write() names no file: say where, and what to do
            where = "" if run_root in message else f" (writing under {run_root})"
            message += f"{where}; free space there and run again: committed shards are kept"
        if code != EXIT_USER_ERROR:
            traceback.print_exc(file=sys.stderr)
        print(f"kdflow worker: {EXIT_CODE_NAMES.get(code, 'error')}: {message}", file=sys.stderr, flush=True)
        emit(ERROR_PREFIX, {"exit_code": code, "kind": EXIT_CODE_NAMES.get(code, "error"), "type": type(error).__name__,
                            "message": message, "pid": os.getpid()})
        return code


def main() -> None:
    set_parent_death_signal()
    code = run()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: after a CUDA driver error, destroying the context can hang or crash.
    os._exit(code)


if __name__ == "__main__":
    main()
