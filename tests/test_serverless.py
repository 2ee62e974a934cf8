"""kdflow/commands/serverless.py: Prefect's settings for a run without a server (a temporary one), a server named by
PREFECT_API_URL that is not there, and the terminal's one-line errors."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

import pytest
from support.network import closed_port

from kdflow.schemas.errors import ConfigError, KDFlowError


def test_terminal_lines_of_kdflow_errors_have_no_traceback_and_other_handlers_keep_it() -> None:
    from kdflow.commands.serverless import DropRepeatedErrors, OneLineErrors

    def record(error: BaseException, msg: str = "Task run failed with exception: %r") -> logging.LogRecord:
        try:
            raise error
        except BaseException:
            return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, msg, (error,), sys.exc_info())

    formatter, plain = OneLineErrors("%(message)s"), logging.Formatter("%(message)s")
    ours = record(ConfigError("dataset.path='x' does not exist"))
    assert formatter.format(ours) == "Task run failed with exception: ConfigError(\"dataset.path='x' does not exist\")"
    assert "Traceback" in plain.format(ours)  # the same record, for the API handler: still with its traceback
    bug = record(ValueError("a bug"))
    assert "Traceback" in formatter.format(bug)  # not kdflow's own error: the traceback stays
    assert not DropRepeatedErrors().filter(record(ConfigError("x"), "Encountered exception during execution: %r"))
    assert (DropRepeatedErrors().filter(ours)
            and DropRepeatedErrors().filter(record(ValueError("y"), "Encountered exception %r")))

    from kdflow.tasks.corpus.records import DataError  # a kdflow error defined beside its stage's reader

    assert DataError.__name__ == "DataError"

    def state(text: str, logger: str = "prefect.flow_runs") -> bool:  # as Prefect logs a run's end, no exc_info
        return DropRepeatedErrors().filter(logging.LogRecord(logger, logging.INFO, __file__, 1, "Finished in state %s",
                                                             (text,), None))

    # The task's, each subflow's and the flow's end repeated kdflow's line three times before kdflow said it.
    assert not state("Failed('Flow run encountered an exception: DataError: line 31 is not valid JSON')")
    assert not state("Failed('Task run encountered an exception StoreError: shard 2 is missing')", "prefect.task_runs")
    assert state("Failed('Flow run encountered an exception: ValueError: a bug')")  # not kdflow's: kept
    assert state("Completed()") and state("Crashed('Execution was cancelled')")
    assert state("Failed('Flow run encountered an exception: DataError: x')", "kdflow.flows")  # only Prefect's


def test_serverless_settings_keep_what_the_user_set(monkeypatch) -> None:
    from kdflow.commands.serverless import STARTUP_TIMEOUT_S, serverless_settings

    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    monkeypatch.delenv("DO_NOT_TRACK", raising=False)  # restored after the test (serverless_settings sets it)
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "true")  # the user's choice: kept
    with serverless_settings() as applied:
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        assert applied == {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": STARTUP_TIMEOUT_S}
        assert PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() == STARTUP_TIMEOUT_S
    assert os.environ.get("DO_NOT_TRACK")




def test_a_prefect_api_url_that_does_not_answer_is_one_line_before_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was Prefect's "RuntimeError: Failed to reach API at ...", not saying where the URL came from."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from kdflow.commands.serverless import serverless_settings

    closed = closed_port(monkeypatch)
    url = f"http://127.0.0.1:{closed}/api"
    with temporary_settings(updates={PREFECT_API_URL: url}), pytest.raises(KDFlowError) as caught:
        with serverless_settings():
            pytest.fail("a server that is not there was taken")
    assert str(caught.value) == (
        f"PREFECT_API_URL='{url}' (from the environment or the Prefect profile) cannot be reached (127.0.0.1:{closed}: "
        "Connection refused): start that server (infra/start-server.sh), or unset PREFECT_API_URL to run on a "
        "temporary one")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{listening.getsockname()[1]}/api"}):
            with serverless_settings() as applied:  # a server that answers: taken as it is
                assert isinstance(applied, dict)


UP_THEN_WAIT = """
import pathlib, sys, time
from kdflow.commands.serverless import serverless_settings
with serverless_settings():
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        client.hello()  # Prefect starts its temporary server for the first client
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(300)
"""


def test_kill_9_of_kdflow_does_not_leave_its_temporary_server_running(children, tmp_path) -> None:
    """The server was left running, re-parented to PID 1, until killed by hand: it now watches its parent."""
    marker, up = f"KDFLOW_TEST_RUN={uuid.uuid4().hex}", tmp_path / "up"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KDFLOW_"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "KDFLOW_TEST_RUN": marker.partition("=")[2]}
    with open(tmp_path / "out.log", "w") as sink, children.started(
            [sys.executable, "-c", UP_THEN_WAIT, str(up)], env=env, stdout=sink, stderr=sink) as process:
        children.wait_until(up.exists, what="the temporary server", timeout=300, process=process,
                            output=(tmp_path / "out.log").read_text)
        server = [pid for pid in children.processes_with_env(marker) if pid != process.pid]
        assert len(server) == 1 and os.getsid(server[0]) != os.getsid(process.pid)  # out of kdflow's signals
        os.kill(process.pid, 9)
        children.wait_until(lambda: not children.processes_with_env(marker), what="the server's end", timeout=30)
