"""Child processes of tests: each in its own process group (session), which is killed when the test is done
with it, whatever happened; a child that runs past its limit fails the test with what was waited for and the
tail of its output, never a bare timeout.

`subprocess.run(timeout=...)` kills only the direct child: a `kdflow run` killed that way leaves Prefect's
temporary server (its own child) running. Killing the whole group leaves nothing behind; children that start
a session of their own (the teacher worker, torchrun) die with their parent (parent-death signal).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _tail(text: str | bytes | None, chars: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return (text or "")[-chars:]


def run(args: list[str], *, what: str, timeout: float, input: str | None = None,
        **popen: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True)` in a fresh process group, killed afterwards."""
    process = subprocess.Popen(args, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               **popen)
    stdout, stderr = finish(process, what=what, timeout=timeout, input=input)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


@contextlib.contextmanager
def started(args: list[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """A child in its own process group for the block; the group is killed (and the child reaped) at the end."""
    process = subprocess.Popen(args, start_new_session=True, **popen)
    try:
        yield process
    finally:
        kill_group(process)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)


def wait_until(condition: Any, *, what: str, timeout: float, process: subprocess.Popen | None = None,
               output: Any = None, every_s: float = 0.1) -> None:
    """Poll `condition()` until true; fail naming `what` if `process` exits first or `timeout` passes.
    `output()` (optional) gives the text to show on failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the process exited ({process.returncode}) before {what}\n{_tail(output() if output else '')}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s\n{_tail(output() if output else '')}")
        time.sleep(every_s)


def processes_with_env(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` (e.g. `KDFLOW_TEST_RUN=<uuid>`), zombies excluded."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker.encode() not in handle.read():
                    continue
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z":
            found.append(int(entry))
    return found


def finish(process: subprocess.Popen, *, what: str, timeout: float, input: str | None = None) -> tuple[Any, Any]:
    """`process.communicate(input)` within `timeout`; on overrun the group is killed and the test fails naming
    `what`. The group is killed afterwards either way (whatever it started there and left running).
    -> (stdout, stderr)."""
    try:
        return process.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        stdout, stderr = process.communicate()
        pytest.fail(f"{what} did not finish within {timeout:.0f} s (killed); its last output:\n{_tail(stdout)}\n"
                    f"{_tail(stderr)}")
    finally:
        kill_group(process)
