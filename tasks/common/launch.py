"""Child processes started by flows (the teacher worker, torchrun): launched, followed and supervised here.

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

from kdflow.schemas.config import KDFlowConfig, dump_config
from kdflow.schemas.protocol import PARENT_PID_ENV, normalise_returncode, parse_line
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
    # own progress reaches the flow as protocol lines.
    child_env = ({"TQDM_DISABLE": "1"} | os.environ | {PARENT_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
                 | (env or {}))
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
