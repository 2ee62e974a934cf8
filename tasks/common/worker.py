"""The child-process side of the worker protocol, shared by the teacher worker and every torchrun rank.

A worker asks the kernel to SIGKILL it when its parent dies (Linux PR_SET_PDEATHSIG), so killing the flow
never leaves a teacher holding a GPU. `run_worker_main` is every worker's guarded main: the parent-death
signal, then the worker's `run` (its arguments, logging set-up and body), then `exit_now`. `run_worker`
turns whatever the worker's body raises into an exit code and a `KDFLOW_ERROR` line, and its successful
summary into a `KDFLOW_RESULT` line; `exit_now` ends the process without interpreter teardown.
Stdlib imports only at the top: no torch before the body runs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from kdflow.schemas.errors import first_line
from kdflow.schemas.protocol import (ERROR_PREFIX, EXIT_CODE_NAMES, EXIT_NO_SPACE, EXIT_OK, EXIT_USER_ERROR,
                                     PARENT_PID_ENV, RESULT_PREFIX, emit)

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:
    """SIGKILL this process when the parent dies (Linux only; elsewhere the parent kills the process group)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and int(expected) != os.getppid():
        os._exit(128 + int(signal.SIGKILL))  # the parent died before prctl took effect


def configure_logging(level: int, tag: str = "") -> None:
    """Log lines on stderr. Started by a flow, which stamps every line it forwards with its own time, they carry
    no timestamp of their own (one per line in the run log); started by hand, they do."""
    stamp = "" if os.environ.get(PARENT_PID_ENV) else "%(asctime)s "
    logging.basicConfig(level=level, stream=sys.stderr, format=f"{stamp}{tag}%(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    quiet_store_loggers()


def quiet_store_loggers() -> None:
    """The S3 client's INFO lines ("Found credentials in environment variables", "Found endpoint for s3 via")
    on every command and worker: warnings and errors only."""
    for name in ("botocore", "aiobotocore", "s3fs"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_worker(body: Callable[[], dict[str, Any] | None], *, label: str, error_fields: dict[str, Any] | None = None,
               writes_under: Callable[[], str | None] = lambda: None) -> int:
    """Run `body`; -> the exit code (never raises). Its summary, if any, goes out as the result line.

    label: how the worker names itself on stderr ("kdflow worker", "kdflow train worker rank 1").
    error_fields: added to the error line (e.g. the rank). writes_under: the run root, once known, so that a
    full disk (whose write() names no file) says where and what to do.
    """
    from kdflow.tasks.common.failures import exit_code_for

    try:
        summary = body()
        if summary is not None:
            emit(RESULT_PREFIX, summary)
        return EXIT_OK
    except BaseException as error:  # noqa: BLE001 - every failure must become an exit code
        code = exit_code_for(error)
        message = first_line(error)
        run_root = writes_under()
        if code == EXIT_NO_SPACE and run_root and "disk full at " not in message:  # DiskFull says it all itself
            where = "" if run_root in message else f" (writing under {run_root})"
            message += f"{where}; free space there and run again: committed shards are kept"
        if code != EXIT_USER_ERROR:
            traceback.print_exc(file=sys.stderr)
        kind = EXIT_CODE_NAMES.get(code, "error")
        print(f"{label}: {kind}: {message}", file=sys.stderr, flush=True)
        emit(ERROR_PREFIX, {"exit_code": code, "kind": kind, "type": type(error).__name__, "message": message,
                            "pid": os.getpid(), **(error_fields or {})})
        return code


def exit_now(code: int) -> NoReturn:
    """Flush and exit without interpreter teardown: after a CUDA driver error, destroying the context can hang
    or crash, and a rank whose peers died can hang in the process group's destructor."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker_main(run: Callable[[], int]) -> NoReturn:
    """A worker's `__main__`: die with the parent, run (which never raises: see `run_worker`), exit with its code
    without interpreter teardown."""
    set_parent_death_signal()
    exit_now(run())
