"""Cancel the flow runs that this machine's workers started, before infra/stop-all.sh stops the workers.

A process worker starts each flow run in a session of its own, so a run outlives a worker stopped with TERM: it
would go on holding its GPU, headless, while a restarted worker starts the next run on the same GPU. So every
run in progress (Pending, Running or Cancelling) whose process is on this host is cancelled through the API
while its worker is still there to stop it; a run still alive after the grace period has its process group ended
here, and is marked Cancelled. Its committed work stays: a rerun resumes.

    python infra/stop_flow_runs.py [--grace-s 30]       # PREFECT_API_URL: the server (stop-all.sh sets it,
                                                        # and the grace from KDFLOW_STOP_GRACE_S)

Prints one line per cancelled run on stderr; exits 1 if it could not cancel (no Prefect, the server failed).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import socket
import sys
import time
from typing import Any

MESSAGE = "cancelled by infra/stop-all.sh: a rerun resumes"


def note(text: str) -> None:
    print(f"[kdflow infra] {text}", file=sys.stderr)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if b"=" in item)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


def local_pid(flow_run: Any) -> int | None:
    """The pid of `flow_run`'s process if it runs on this host, else None. The server records a process worker's
    run as its pid (`HOST:PID` in some Prefect versions); the process there is this run's only if its environment
    names the run (PREFECT__FLOW_RUN_ID), which also rules out another host's pid and a pid used again."""
    host, _, pid = (flow_run.infrastructure_pid or "").rpartition(":")
    if (host and host != socket.gethostname()) or not pid.isdigit() or not _alive(int(pid)):
        return None
    return int(pid) if _environ(int(pid)).get("PREFECT__FLOW_RUN_ID") == str(flow_run.id) else None


def _end(pid: int) -> None:
    """TERM, then KILL after 5 s, to the process group `pid` leads (a worker starts each run in its own session),
    or to `pid` alone if it shares this script's group."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if group == os.getpgrp():
                os.kill(pid, sig)
            else:
                os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            return
        for _ in range(20):
            if not _alive(pid):
                return
            time.sleep(0.25)


async def stop_runs(grace_s: float) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Cancelling

    live = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])))
    async with get_client() as client:
        runs = {flow_run.id: (flow_run, pid) for flow_run in await client.read_flow_runs(flow_run_filter=live)
                if (pid := local_pid(flow_run)) is not None}
        for flow_run, _ in runs.values():
            if flow_run.state.type != StateType.CANCELLING:  # the worker sees this, stops the process, says Cancelled
                await client.set_flow_run_state(flow_run.id, Cancelling(message=MESSAGE), force=True)
        deadline = time.monotonic() + grace_s
        while any(_alive(pid) for _, pid in runs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        for flow_run, pid in runs.values():
            how = "its worker stopped it"
            if _alive(pid):  # no worker acted on the cancellation (stopped already, or hung): end it here
                _end(pid)
                how = f"its process {pid} was ended here"
            state = (await client.read_flow_run(flow_run.id)).state
            if state is None or state.type != StateType.CANCELLED:  # an ended run's engine says Crashed, on TERM
                await client.set_flow_run_state(flow_run.id, Cancelled(message=MESSAGE), force=True)
            note(f"cancelled flow run {flow_run.name} ({flow_run.id}): {how}; a rerun resumes")
    return len(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="how long the workers get to stop their runs before this ends them (30)")
    args = parser.parse_args(argv)
    api_url = os.environ.get("PREFECT_API_URL", "")
    if not api_url:
        note("PREFECT_API_URL is not set: no flow run cancelled")
        return 0
    if importlib.util.find_spec("prefect") is None:
        note(f"Prefect is not installed beside {sys.executable} (KDFLOW_PYTHON): no flow run cancelled")
        return 1
    try:
        asyncio.run(stop_runs(args.grace_s))
    except Exception as error:  # the server went away or refused: what was not cancelled yet stays as it is
        note(f"cancelling flow runs through {api_url} failed ({type(error).__name__}: {error}): a run started here "
             "may still be going; cancel it in the UI or with `prefect flow-run cancel ID`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
