"""Prefect artifacts kept by key: progress bars and tables updated in place, markdown published as versions.

Every artifact is a view of what the run root already holds, so none of this may fail a run: without an
API that takes artifacts (an old server, none at all) each one quietly turns itself off, and the log
keeps the numbers.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import time
from typing import Any

logger = logging.getLogger("kdflow.artifacts")


def artifact_key(*parts: str) -> str:
    """An artifact key from free text: lower-case letters, digits and dashes only (Prefect's rule)."""
    text = "-".join(parts).lower()
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9]+", "-", text)).strip("-")


def png_markdown(png: bytes, alt: str) -> str:
    """An image inside markdown, as a data: URI (no file server needed to show it)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


class _Keyed:
    def __init__(self, key: str) -> None:
        self.key, self.artifact_id, self.enabled = key, None, True

    def _off(self, error: Exception) -> None:
        self.enabled = False
        logger.debug("artifact %s turned off: %s", self.key, error)


class KeyedProgress(_Keyed):
    """A progress artifact under `key`: created on the first update, then updated in place, at most every
    `every_s` seconds (always at 0 % and 100 %)."""

    def __init__(self, key: str, every_s: float = 5.0) -> None:
        super().__init__(key)
        self.every_s, self.last = every_s, float("-inf")
        self.updates = 0

    def set(self, percent: float, description: str, *, force: bool = False) -> None:
        now = time.monotonic()
        percent = round(max(0.0, min(100.0, percent)), 1)
        if not self.enabled or (now - self.last < self.every_s and not force and 0 < percent < 100):
            return
        self.last = now
        try:
            from prefect.artifacts import create_progress_artifact, update_progress_artifact

            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(percent, key=self.key, description=description)
            else:
                update_progress_artifact(self.artifact_id, percent, description=description)
            self.updates += 1
        except Exception as error:  # noqa: BLE001 - a progress bar must never fail the run
            self._off(error)


class KeyedTable(_Keyed):
    """A table artifact under `key`: created once, then its rows replaced in place when they change."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.rows: list[dict[str, Any]] | None = None

    def set(self, rows: list[dict[str, Any]], description: str) -> None:
        if not self.enabled or rows == self.rows:
            return
        try:
            from prefect.artifacts import create_table_artifact
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import ArtifactUpdate

            if self.artifact_id is None:
                self.artifact_id = create_table_artifact(rows, key=self.key, description=description)
            else:
                with get_client(sync_client=True) as client:
                    client.update_artifact(self.artifact_id,
                                           ArtifactUpdate(data=json.dumps(rows), description=description))
            self.rows = rows
        except Exception as error:  # noqa: BLE001 - a table is a view; the run goes on without it
            self._off(error)


def publish_markdown(key: str | None, markdown: str, description: str) -> bool:
    """A markdown artifact (a new version under `key`); -> whether it was published."""
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(key=key, markdown=markdown, description=description)
        return True
    except Exception as error:  # noqa: BLE001 - a report is a view; it must never fail a finished run
        logger.warning("no %s artifact (%s)", key or "markdown", error)
        return False


def ui_link(key: str) -> str:
    """A markdown link to the artifact page of `key`: absolute when the UI's address is known."""
    try:
        from prefect.settings import get_current_settings

        base = get_current_settings().ui_url
    except Exception:  # noqa: BLE001 - no settings: a relative link still works inside the UI
        base = None
    return f"[{key}]({(base or '').rstrip('/')}/artifacts/key/{key})"
