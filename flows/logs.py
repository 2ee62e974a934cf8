"""The `kdflow` logger of the pure code forwarded into Prefect run logs, at INFO; installed when a flow module
is imported (each imports kdflow.flows.common, which imports this), so that importing `kdflow.flows` alone
loads no Prefect. (Prefect's own `PREFECT_LOGGING_EXTRA_LOGGERS=kdflow` attaches its API handler but leaves
the logger's level unset, so the root's WARNING applies, and outside a flow run that handler warns about
every record.)
"""

from __future__ import annotations

import logging


class _RunLogHandler(logging.Handler):
    """Hands `kdflow` records to Prefect's API log handler inside flow and task runs; outside them (a test, a
    command that is not a flow) the records only reach the console."""

    def __init__(self, api_handler: logging.Handler) -> None:
        super().__init__()
        self.api_handler = api_handler

    def emit(self, record: logging.LogRecord) -> None:
        from prefect.context import FlowRunContext, TaskRunContext

        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            self.api_handler.handle(record)


def forward_kdflow_logs() -> None:
    """At INFO unless set already (the CLI's -v: DEBUG); once, whoever imports first."""
    from prefect.logging.handlers import APILogHandler

    kdflow_logger = logging.getLogger("kdflow")
    if kdflow_logger.level == logging.NOTSET:  # the CLI's -v sets DEBUG before it imports the flows
        kdflow_logger.setLevel(logging.INFO)
    if any(isinstance(h, (APILogHandler, _RunLogHandler)) for h in kdflow_logger.handlers):
        return  # PREFECT_LOGGING_EXTRA_LOGGERS=kdflow did it already
    kdflow_logger.addHandler(_RunLogHandler(APILogHandler()))
