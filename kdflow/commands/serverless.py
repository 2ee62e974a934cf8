"""Prefect without a server, as `kdflow run` and `kdflow demo` use it: the temporary server's settings, and
terminal output where kdflow's own errors are one line.

Without `PREFECT_API_URL`, Prefect starts a temporary server (a uvicorn subprocess on SQLite) and waits for
it `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (Prefect's default: 20 s). On two busy cores, or with
two runs starting at once on one `PREFECT_HOME`, that start took 40-80 s, so kdflow waits up to
`STARTUP_TIMEOUT_S`. The server also sends a telemetry heartbeat, which logs an ERROR with a traceback
when there is no internet; kdflow turns server analytics off (and sets `DO_NOT_TRACK`, which Prefect's
client-side telemetry reads). A setting the user gave (environment or Prefect profile) is never changed.

The server is kdflow's child but not in its process group: Ctrl-C, `timeout`, systemd and `kill -TERM -- -PGID`
signal a whole group, and the server, stopped first, took Prefect's report of the interrupted run down with it
(minutes of retries, then "Connection refused" instead of "kdflow: interrupted"). It runs in a session of its
own, so those signals reach kdflow alone, which unwinds and stops the server at exit (Prefect's atexit); and it
watches its parent, so a `kill -9` of kdflow does not leave it running, re-parented to PID 1.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
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
            _guard_temporary_server()
        elif why := endpoint_unreachable(api_url):  # Prefect said "RuntimeError: Failed to reach API at ..."
            raise KDFlowError(f"PREFECT_API_URL={api_url!r} (from the environment or the Prefect profile) cannot be "
                              f"reached ({why}): start that server (infra/start-server.sh), or unset PREFECT_API_URL "
                              "to run on a temporary one")
        yield {setting.name: value for setting, value in updates.items()}


# The temporary server's program: uvicorn as Prefect starts it, plus a thread that stops it once the process that
# started it is gone (SIGTERM, uvicorn's graceful stop, then exit). Source text rather than a kdflow module, so
# that no checkout in the working directory can shadow it.
_SERVER_WATCH = """\
import os, runpy, signal, sys, threading, time
parent = int(sys.argv[1])
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(20)
    os._exit(1)
threading.Thread(target=watch, daemon=True).start()
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _guard_temporary_server() -> None:
    """Start Prefect's temporary server, when Prefect starts it, in its own session and watching kdflow."""
    import prefect.server.api.server as server_module

    server = server_module.SubprocessASGIServer()  # the instance Prefect's clients start and use (one per port)
    start_process = getattr(server, "_run_uvicorn_command", None)
    if start_process is None or getattr(start_process, "_kdflow_guarded", False):
        return  # another Prefect (its server then shares kdflow's signals, as before), or done already
    real = server_module.subprocess

    def popen(args: list[str], **options: object) -> object:
        args = list(args)
        if args[1:3] == ["-m", "uvicorn"]:
            args = [args[0], "-c", _SERVER_WATCH, str(os.getpid()), *args[2:]]
        return real.Popen(args, start_new_session=True, **options)

    class Subprocess:  # Prefect's `subprocess`, but for its Popen, while it starts the server
        Popen = staticmethod(popen)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    def start_guarded() -> object:
        server_module.subprocess = Subprocess()
        try:
            return start_process()
        finally:
            server_module.subprocess = real

    start_guarded._kdflow_guarded = True  # type: ignore[attr-defined]
    server._run_uvicorn_command = start_guarded  # type: ignore[method-assign]


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


_FAILED_STATE = re.compile(r"Finished in state Failed\('(?:Task|Flow) run encountered an exception:? (\w+): ")


def _kdflow_error_names() -> set[str]:
    names, todo = set(), [KDFlowError]
    while todo:
        error = todo.pop()
        names.add(error.__name__)
        todo.extend(error.__subclasses__())
    return names


class DropRepeatedErrors(logging.Filter):
    """Drop Prefect's repeats of a kdflow error: its "Encountered exception during execution" record, and the
    "Finished in state Failed(...)" lines of the task, each subflow and the flow, which said the same line three
    more times before kdflow's own. The task's "Task run failed with exception" line stays (it says where)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("prefect"):
            return True
        if record.exc_info and _kdflow_error_in(record.exc_info):
            return not str(record.msg).startswith("Encountered exception during execution")
        failed = _FAILED_STATE.match(record.getMessage())
        return failed is None or failed.group(1) not in _kdflow_error_names()


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
