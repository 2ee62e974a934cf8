"""The protocol between a flow and the child processes it starts (the teacher worker, torchrun's ranks).

Both sides import this module, and nothing else defines these names (stdlib only: the flow imports it
without loading torch).

Exit codes: 0 done, 1 unexpected (a bug), 2 user error (bad config or input, never retried), 3 no space
left, 4 the object store unreachable, 70-75 CUDA driver failures, 128+N killed by signal N. The flow retries
exactly RETRYABLE_EXIT_CODES, each time in a new process, since a CUDA context broken by a driver reset dies only
with its process (and a store that went away is often back by the retry).

Lines on the child's stdout that start with a prefix are for the parent; every other line is free text
for the run log:
    KDFLOW_PROGRESS {...}   progress (stage, done, total, tokens, tokens_per_s, eta_s, ...)
    KDFLOW_RESULT {...}     the child's summary, once, on success
    KDFLOW_ERROR {...}      exit_code, kind, type and a one-line message (and rank), once, on failure
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

PROGRESS_PREFIX = "KDFLOW_PROGRESS "
RESULT_PREFIX = "KDFLOW_RESULT "
ERROR_PREFIX = "KDFLOW_ERROR "
PARENT_PID_ENV = "KDFLOW_PARENT_PID"  # the child checks it is still this process's child (parent-death signal)
LEASE_OWNER_ENV = "KDFLOW_LEASE_OWNER"  # the flow passes one owner to every retry, so a retry takes over its lease

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # a bug or an unknown failure: retrying would hide it
EXIT_USER_ERROR = 2  # KDFlowError: bad config or input, never retried
EXIT_NO_SPACE = 3  # disk or object store full: retrying cannot help until someone frees space
EXIT_STORE_UNREACHABLE = 4  # the run root's object store could not be reached: often brief, retried with backoff
EXIT_CUDA_ERROR = 70  # any other CUDA / driver / cuBLAS / NCCL error
EXIT_CUDA_NOT_READY = 71
EXIT_CUDA_LAUNCH_FAILURE = 72
EXIT_CUDA_ILLEGAL_ADDRESS = 73
EXIT_CUDA_ECC = 74
EXIT_CUDA_OOM = 75

# A worker killed by one of these signals (the kernel's OOM killer, a driver crash) is retried too.
RETRYABLE_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)

RETRYABLE_EXIT_CODES: frozenset[int] = frozenset(
    {EXIT_STORE_UNREACHABLE, EXIT_CUDA_ERROR, EXIT_CUDA_NOT_READY, EXIT_CUDA_LAUNCH_FAILURE,
     EXIT_CUDA_ILLEGAL_ADDRESS, EXIT_CUDA_ECC, EXIT_CUDA_OOM}
    | {128 + int(s) for s in RETRYABLE_SIGNALS}
)

EXIT_CODE_NAMES = {
    EXIT_OK: "done",
    EXIT_UNEXPECTED: "unexpected error",
    EXIT_USER_ERROR: "user error",
    EXIT_NO_SPACE: "no space left on device",
    EXIT_STORE_UNREACHABLE: "object store unreachable",
    EXIT_CUDA_ERROR: "CUDA error",
    EXIT_CUDA_NOT_READY: "CUDA device not ready",
    EXIT_CUDA_LAUNCH_FAILURE: "CUDA launch failure",
    EXIT_CUDA_ILLEGAL_ADDRESS: "CUDA illegal memory access",
    EXIT_CUDA_ECC: "CUDA ECC error",
    EXIT_CUDA_OOM: "CUDA out of memory",
}


def normalise_returncode(returncode: int) -> int:
    """subprocess returncode -> exit code: a death by signal N (returncode -N) becomes 128 + N, as shells do."""
    return 128 - returncode if returncode < 0 else returncode


def is_retryable(exit_code: int) -> bool:
    return exit_code in RETRYABLE_EXIT_CODES


def describe_exit_code(exit_code: int) -> str:
    if exit_code in EXIT_CODE_NAMES:
        return EXIT_CODE_NAMES[exit_code]
    if exit_code > 128:
        try:
            return f"killed by {signal.Signals(exit_code - 128).name}"
        except ValueError:
            pass
    return f"exit code {exit_code}"


# --- lines on stdout --------------------------------------------------------------------------------------


def emit(prefix: str, payload: dict[str, Any]) -> None:
    """Child side: one machine-readable line for the parent."""
    sys.stdout.write(prefix + json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def parse_line(line: str) -> tuple[str, dict[str, Any]] | None:
    """Parent side: ('progress' | 'result' | 'error', payload) for a protocol line, None for free text."""
    for kind, prefix in (("progress", PROGRESS_PREFIX), ("result", RESULT_PREFIX), ("error", ERROR_PREFIX)):
        if line.startswith(prefix):
            return kind, json.loads(line[len(prefix):])
    return None


# --- the teacher worker's --shards argument ---------------------------------------------------------------


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
