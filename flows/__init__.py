"""Prefect flows and thin tasks over the pure logic in `tasks/`.

Importing this package forwards the `kdflow` logger of the pure code into run logs, at INFO. (Prefect's own
`PREFECT_LOGGING_EXTRA_LOGGERS=kdflow` attaches its API handler but leaves the logger's level unset, so the
root's WARNING applies, and outside a flow run that handler warns about every record.)
"""

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


def _forward_kdflow_logs() -> None:
    from prefect.logging.handlers import APILogHandler

    kdflow_logger = logging.getLogger("kdflow")
    if kdflow_logger.level == logging.NOTSET:  # the CLI's -v sets DEBUG before it imports the flows
        kdflow_logger.setLevel(logging.INFO)
    if any(isinstance(h, (APILogHandler, _RunLogHandler)) for h in kdflow_logger.handlers):
        return  # PREFECT_LOGGING_EXTRA_LOGGERS=kdflow did it already
    kdflow_logger.addHandler(_RunLogHandler(APILogHandler()))


_forward_kdflow_logs()
