"""Real sockets for the reachability checks (kdflow.tasks.common.hub_access): a port nothing listens on, with no
proxy in the environment and no earlier answer kept, so the check connects for real."""

from __future__ import annotations

import socket

import pytest


def closed_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """A local port nothing listens on ("Connection refused"); proxies unset and kept answers forgotten."""
    from kdflow.tasks.common import hub_access

    for name in hub_access._PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_access, "_answers", {})
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
