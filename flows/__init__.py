"""Prefect flows and thin tasks over the pure logic in `kdflow.tasks`.

Importing this package loads no Prefect; each flow module does, and installs the forwarding of the `kdflow`
logger into run logs (kdflow.flows.logs) when it is imported.
"""
