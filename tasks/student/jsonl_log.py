"""The student's jsonl logs (metrics.jsonl, eval.jsonl): records with a `step`, kept consistent with the
checkpoint a run resumes from (kdflow.tasks.student.train)."""

from __future__ import annotations

import json
import os
from typing import Any

from kdflow.schemas.disk_space import DiskFull, is_no_space
from kdflow.schemas.storage import RunRoot


class JsonlLog:
    """A jsonl file of records with a `step`; on resume, records after the resumed step are dropped.
    Local files are appended line by line; on object stores the file is rewritten on `flush()`. A file
    that needs no change is never rewritten (a rerun of a finished run touches nothing)."""

    def __init__(self, run_root: RunRoot, path: str, keep_through_step: int, enabled: bool = True) -> None:
        self.run_root, self.path, self.enabled = run_root, path, enabled
        on_disk = read_jsonl(run_root, path)
        self.records = [r for r in on_disk if r.get("step", 0) <= keep_through_step]
        self._persisted = len(on_disk)  # records the file holds, in order
        if len(self.records) != len(on_disk):
            self._persisted = -1
            self.flush()

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.enabled and self.run_root.is_local and self._persisted == len(self.records) - 1:
            size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            try:
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
            except OSError as error:  # a full disk: no half line stays behind for the resume to trip on
                os.truncate(self.path, size)
                if is_no_space(error):
                    raise DiskFull(self.path, 4096) from error
                raise
            self._persisted += 1

    def flush(self) -> None:
        if self.enabled and self._persisted != len(self.records):
            text = "".join(json.dumps(record) + "\n" for record in self.records)
            self.run_root.write_bytes_atomic(self.path, text.encode())
            self._persisted = len(self.records)


def read_jsonl(run_root: RunRoot, path: str) -> list[dict[str, Any]]:
    try:
        text = run_root.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
