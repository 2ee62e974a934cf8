"""A Prefect server on SQLite (its own PREFECT_HOME, a free loopback port) with the workers
infra/start-workers.sh starts, the way users run the deployments; everything it starts is stopped at the end
(process groups), flow runs still going included."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
PREFECT = str(Path(sys.executable).parent / "prefect")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PrefectStack:
    api_url: str
    env: dict[str, str]  # what every prefect command here runs with
    root: Path
    timings: dict[str, float]

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        result = subprocess.run(args, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, (f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                                        f"{result.stderr[-3000:]}")
        return result

    def client_call(self, make_coroutine: Callable[[Any], Any]) -> Any:
        """Run `make_coroutine(client)` against this server (the test process has no API URL of its own)."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        async def call() -> Any:
            async with get_client() as client:
                return await make_coroutine(client)

        with temporary_settings({PREFECT_API_URL: self.api_url}):
            return asyncio.run(call())


def _wait_healthy(api_url: str, server: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the Prefect server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if json.load(urllib.request.urlopen(f"{api_url}/health", timeout=2)) is True:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the Prefect server was not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _kill_flow_run_processes(stack: PrefectStack) -> None:
    """Flow runs still going after infra/stop-all.sh (which cancels them first: this is for a stack whose server or
    script failed): process workers start each run in its own session and leave it running when they stop, so kill
    their process groups by the pid the server recorded (only processes of this server, by environment)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    live = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])))

    async def read(client: Any) -> list[Any]:
        return await client.read_flow_runs(flow_run_filter=live)

    for flow_run in stack.client_call(read):
        host, _, pid = (flow_run.infrastructure_pid or "").rpartition(":")  # Prefect 3.9 records the pid alone
        if (host and host != socket.gethostname()) or not pid.isdigit():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"PREFECT_API_URL={stack.api_url}".encode() in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)


def _stop_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def started_stack(root: Path) -> Iterator[PrefectStack]:
    """The server, the pools of infra/create-pools.sh, two workers on `gpu` and one on `cpu`."""
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KDFLOW_"))}
    env.update(
        PREFECT_HOME=str(root / "prefect-home"), PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # Workers poll every second instead of ten; flow results are kept so the test can read what each run did.
        PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_RESULTS_PERSIST_BY_DEFAULT="true",
        PREFECT_LOCAL_STORAGE_PATH=str(root / "results"),
        KDFLOW_STATE_DIR=str(root / "state"), KDFLOW_PYTHON=sys.executable, KDFLOW_WORKER_PREFIX="test",
        TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
    )
    log = root / "server.log"
    started = time.perf_counter()
    with open(log, "w") as sink:
        server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
                                  env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    stack = PrefectStack(api_url, env, root, {})
    try:
        _wait_healthy(api_url, server, log, timeout=150)
        stack.timings["server_start_s"] = time.perf_counter() - started
        stack.run("bash", str(INFRA / "create-pools.sh"))
        stack.run("bash", str(INFRA / "start-workers.sh"), "2")
        yield stack
    finally:
        subprocess.run(["bash", str(INFRA / "stop-all.sh"), "workers"], env=env, capture_output=True, timeout=120)
        with contextlib.suppress(Exception):  # the server may be the thing that failed
            _kill_flow_run_processes(stack)
        _stop_group(server)
