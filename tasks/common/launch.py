"""The parent half of the worker protocol (the child half is `kdflow.tasks.common.worker`): child processes
(the teacher worker, the tune worker, torchrun) launched, followed and supervised, and how they ended mapped
to one family of errors.

A child starts by its namespaced module name (`python -m kdflow.tasks...`) in its own process group, with
the resolved config in a temporary file. Its protocol lines (`kdflow.schemas.protocol`) are parsed, its
other lines forwarded to the run log. A flow process that is cancelled (SIGTERM), fails while following
its child, or exits takes the child's whole process group down with it; the children also ask the kernel
to kill them if this process dies (parent-death signal, set on their side), which covers SIGKILL too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import dump_config
from kdflow.schemas.errors import KDFlowError
from kdflow.schemas.protocol import (EXIT_NO_SPACE, EXIT_UNEXPECTED, EXIT_USER_ERROR, PARENT_PID_ENV,
                                     describe_exit_code, is_retryable, normalise_returncode, parse_line)
from kdflow.tasks.common.scratch import scratch_dir

_LIVE_GROUPS: set[int] = set()  # process groups of running children, killed if this process exits


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


atexit.register(lambda: [kill_group(pid) for pid in list(_LIVE_GROUPS)])


@contextlib.contextmanager
def _sigterm_kills(pid: int) -> Iterator[None]:
    """While the child runs, SIGTERM to this process (a cancelled flow run) first kills the child's group."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; atexit and the child's parent-death signal still cover us
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        kill_group(pid)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def supervised(process: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Follow a child started with `start_new_session=True`; on any way out but its own exit, kill its group."""
    _LIVE_GROUPS.add(process.pid)
    try:
        with _sigterm_kills(process.pid):
            yield process
    finally:
        if process.poll() is None:  # cancelled, interrupted or failed while following: take the child down
            kill_group(process.pid)
            process.wait()
        _LIVE_GROUPS.discard(process.pid)


@contextlib.contextmanager
def config_file(config: KDFlowConfig, kind: str) -> Iterator[str]:
    """The resolved config in a scratch folder that the child reads; removed when the child is done, and by
    the next flow if this one is killed (kdflow.tasks.common.scratch)."""
    with scratch_dir(kind) as folder:
        path = os.path.join(folder, "config.yaml")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(dump_config(config))
        yield path


@dataclass
class ChildOutcome:
    """How a child ended: its exit code (128 + N for signal N), its result line, its error lines."""

    pid: int
    exit_code: int
    result: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)


def run_child(module: str, args: list[str], *, env: dict[str, str] | None = None,
              on_started: Callable[[int], None] = lambda pid: None,
              on_progress: Callable[[dict[str, Any]], None] = lambda update: None,
              on_log: Callable[[int, str], None] = lambda pid, line: None) -> ChildOutcome:
    """`python -m MODULE ARGS` in its own process group, followed until it exits; -> its outcome."""
    command = [sys.executable, "-m", module, *args]
    # TQDM_DISABLE: third-party progress bars (the GGUF loader's) would be dozens of run-log lines; the child's
    # own progress reaches the flow as protocol lines. PYTHONSAFEPATH: `-m` would put the working directory first on
    # sys.path, where a checkout's root holds a `kdflow/` folder that shadows a non-editable install (and its
    # torchrun ranks inherit it).
    child_env = ({"TQDM_DISABLE": "1"} | os.environ | {PARENT_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1",
                                                      "PYTHONSAFEPATH": "1"} | (env or {}))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                               start_new_session=True, env=child_env)
    outcome = ChildOutcome(process.pid, exit_code=0)
    with supervised(process):
        on_started(process.pid)
        for line in process.stdout:
            line = line.rstrip("\n")
            parsed = parse_line(line)
            if parsed is None:
                if line.strip():
                    on_log(process.pid, line)
            elif parsed[0] == "progress":
                on_progress(parsed[1])
            elif parsed[0] == "result":
                outcome.result = parsed[1]
            else:
                outcome.errors.append(parsed[1])
        outcome.exit_code = normalise_returncode(process.wait())
    return outcome


class WorkerFailed(RuntimeError):
    """A worker (or torchrun) exited with a non-zero code; retried, and a rerun resumes, iff the code is retryable
    (a fresh worker starts at the first uncommitted shard, a training run from its checkpoint)."""

    def __init__(self, exit_code: int, message: str = "", *, worker: str = "worker") -> None:
        self.exit_code, self.message = exit_code, message
        self.rerun_resumes = is_retryable(exit_code)
        super().__init__(f"{worker} failed with exit code {exit_code} ({describe_exit_code(exit_code)})"
                         + (f": {message}" if message else ""))


class WorkerUserError(WorkerFailed, KDFlowError):
    """Exit code 2: bad config or input. The message is the worker's own one-line error."""

    def __str__(self) -> str:
        return self.message or super().__str__()


class WorkerNoSpace(WorkerUserError):
    """Exit code 3: the disk (or bucket) is full. The worker's message names where, and what it needed."""


def outcome_error(outcome: ChildOutcome, *, worker: str, needs_result: bool = True) -> WorkerFailed | None:
    """How a child ended -> the error to raise (None: it succeeded). A rank's or worker's user error (exit code
    2, or 3 for a full disk, on its error line or as the exit code) is that error's own one-line message; any
    other failure names the exit code and the first error line. needs_result: exit code 0 without a result
    line is a failure too (torchrun's rank 0 may report on another node)."""
    code, errors = outcome.exit_code, outcome.errors
    if code == 0:
        if outcome.result is not None or not needs_result:
            return None
        return WorkerFailed(EXIT_UNEXPECTED, "the worker exited without reporting a result", worker=worker)
    user_codes = (EXIT_USER_ERROR, EXIT_NO_SPACE)
    user = next((e for e in errors if e.get("exit_code") in user_codes), None)
    if user is not None or code in user_codes:
        user_code = user.get("exit_code") if user is not None else code
        failure = WorkerNoSpace if user_code == EXIT_NO_SPACE else WorkerUserError
        return failure(user_code, (user or {}).get("message", ""), worker=worker)
    first = errors[0] if errors else {}
    where = f"rank {first['rank']}: " if "rank" in first else ""
    return WorkerFailed(code, f"{where}{first.get('message', '')}" if first else "", worker=worker)
