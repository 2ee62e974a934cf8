"""Child processes that die with the flow: the teacher worker and torchrun run in their own process group.

A flow process that is cancelled (SIGTERM), fails while following its child, or exits takes the child's whole
process group down with it; the children also ask the kernel to kill them if this process dies (parent-death
signal, set on their side), which covers SIGKILL too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

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
