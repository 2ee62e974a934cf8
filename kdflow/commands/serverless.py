"""Prefect without a server, as `kdflow run` and `kdflow demo` use it: the temporary server's settings, and
terminal output where kdflow's own errors are one line.

Without `PREFECT_API_URL`, Prefect starts a temporary server (a uvicorn subprocess on SQLite) and waits for
it `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (Prefect's default: 20 s). On two busy cores, or with
two runs starting at once on one `PREFECT_HOME`, that start took 40-80 s, so kdflow waits up to
`STARTUP_TIMEOUT_S`. The server also sends a telemetry heartbeat, which logs an ERROR with a traceback
when there is no internet; kdflow turns server analytics off (and sets `DO_NOT_TRACK`, which Prefect's
client-side telemetry reads). A setting the user gave (environment or Prefect profile) is never changed.

The server runs as a child of kdflow's process, in the terminal's process group, so Ctrl-C reached it too:
it stopped at once, and Prefect's report of the interrupted run then retried against it for minutes before
kdflow could say "interrupted". kdflow starts it with SIGINT blocked (a blocked signal stays blocked in the
child; uvicorn only sets handlers), so Ctrl-C reaches kdflow alone and the server records the run as
crashed; `kill PID` (SIGTERM) now unwinds kdflow, so the server is stopped at exit, not left behind.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import sys
from collections.abc import Iterator

from kdflow.schemas.errors import KDFlowError
from kdflow.tasks.common.hub_access import endpoint_unreachable

STARTUP_TIMEOUT_S = 300
_DEFAULTS = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": STARTUP_TIMEOUT_S,
             "PREFECT_SERVER_ANALYTICS_ENABLED": False}


@contextlib.contextmanager
def serverless_settings() -> Iterator[dict[str, object]]:
    """Prefect settings for the temporary server, for the duration of the block; -> the ones applied."""
    os.environ.setdefault("DO_NOT_TRACK", "1")  # read from the environment by Prefect's client telemetry
    import prefect.settings as settings

    explicit = set(os.environ)
    with contextlib.suppress(Exception):  # no profiles file, or an unreadable one: only the environment counts
        explicit |= {setting.name for setting in settings.load_current_profile().settings}
    updates = {getattr(settings, name): value for name, value in _DEFAULTS.items() if name not in explicit}
    with settings.temporary_settings(updates=updates), _exit_on_sigterm():
        if not (api_url := settings.PREFECT_API_URL.value()):
            _shield_temporary_server_from_ctrl_c()
        elif why := endpoint_unreachable(api_url):  # Prefect said "RuntimeError: Failed to reach API at ..."
            raise KDFlowError(f"PREFECT_API_URL={api_url!r} (from the environment or the Prefect profile) cannot be "
                              f"reached ({why}): start that server (infra/start-server.sh), or unset PREFECT_API_URL "
                              "to run on a temporary one")
        yield {setting.name: value for setting, value in updates.items()}


def _shield_temporary_server_from_ctrl_c() -> None:
    """Start Prefect's temporary server, when Prefect starts it, with SIGINT blocked in the child."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's clients start and use (one per port, None here)
    start_process = getattr(server, "_run_uvicorn_command", None)
    if (start_process is None or getattr(start_process, "_kdflow_shielded", False)
            or not hasattr(signal, "pthread_sigmask")):
        return  # another Prefect or no POSIX signal masks (Ctrl-C then reaches the server as before), or done

    def start_without_sigint() -> object:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return start_process()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    start_without_sigint._kdflow_shielded = True  # type: ignore[attr-defined]
    server._run_uvicorn_command = start_without_sigint  # type: ignore[method-assign]


class Terminated(SystemExit):
    """SIGTERM during a kdflow command: exits 143 through every `finally` and atexit (the server's stop)."""


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises `Terminated` for the duration of the block. Prefect's flow engine puts its own handler
    in front of this one while a flow runs, reports the run as crashed, then calls this one."""

    def terminate(signum: int, frame: object) -> None:
        raise Terminated(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: signals are not ours to set
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kdflow_error_in(exc_info: object) -> bool:
    if not isinstance(exc_info, tuple) or len(exc_info) < 2:
        return False
    error, seen = exc_info[1], 0
    while error is not None and seen < 16:
        if isinstance(error, KDFlowError):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class OneLineErrors(logging.Formatter):
    """A terminal formatter for kdflow's commands: a record that carries a kdflow error (bad input or state,
    KDFlowError) shows its message without the traceback (Prefect logs the same error with a traceback at the
    task, at each subflow and at the flow). Other errors keep theirs. Records are copied, never changed,
    so other handlers (Prefect's API log handler: the run logs in the UI) still get the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and _kdflow_error_in(record.exc_info):
            record = copy.copy(record)
            record.exc_info, record.exc_text = None, None
        return super().format(record)


class DropRepeatedErrors(logging.Filter):
    """Drop Prefect's "Encountered exception during execution" records of a kdflow error: the same run's
    "Finished in state Failed(...)" line right after says it again, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("prefect") and record.exc_info and _kdflow_error_in(record.exc_info)
                    and str(record.msg).startswith("Encountered exception during execution"))


class ShownByItsLibrary(logging.Filter):
    """Drop a record that a library's own terminal handler printed already: huggingface_hub and datasets put a
    StreamHandler on their loggers and still propagate, so each of their warnings (a hub retry) came out twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None and logger.parent is not None:  # up to, not including, the root logger
            if any(type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stderr, sys.stdout)
                   and record.levelno >= h.level for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


def install_terminal_logging(handler: logging.Handler, verbose: bool) -> None:
    """kdflow's terminal handler: one-line kdflow errors, unless `-v` asks for every traceback; each record once."""
    handler.addFilter(ShownByItsLibrary())
    if verbose:
        return
    handler.setFormatter(OneLineErrors(handler.formatter._fmt if handler.formatter else None,  # noqa: SLF001
                                       handler.formatter.datefmt if handler.formatter else None))
    handler.addFilter(DropRepeatedErrors())
