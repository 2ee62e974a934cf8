"""Prefect flows and thin tasks over the pure logic in `tasks/`.

Importing this package makes Prefect forward the `kdflow` logger of the pure code into run logs.
"""

import os

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "kdflow")
