"""`corpus/_sources.json`: the dataset's files as materialise found them, before it wrote the store's first part.

Fingerprints name a dataset's settings (its path, fields, split...), not its bytes, so a file edited, added or
removed after materialise would leave every store of the run root as it was, silently made from the old text.
With this record, the next run names the change instead (`kdflow.tasks.corpus.dataset_changes`). A local file is
recorded by size, modification time and sha256; a file on an object store by size and the version its store
reports (ETag, else modification time). A hub dataset has no record (`dataset.revision` pins one).

The record is written only while the store has no part of its fingerprint, and binds from the first part on (a run
that failed before any part leaves one that the next run replaces); stores made before it existed have none, and
are not checked.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kdflow.schemas.commits import list_commits
from kdflow.schemas.layout import SOURCES_FILE
from kdflow.schemas.storage import RunRoot

SOURCES_FORMAT = "kdflow.corpus-sources.v1"


class RecordedFile(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str  # as the config resolves it: a local path (relative where the config's is) or a URL
    size: int
    mtime_ns: int | None = None  # local files
    sha256: str | None = None  # local files
    version: str | None = None  # object stores: the ETag, or the modification time, as the store reports it


class DatasetRecord(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    format: Literal["kdflow.corpus-sources.v1"] = SOURCES_FORMAT
    fingerprint: str  # the corpus store's fingerprint: a record of another one says nothing about this store
    files: list[RecordedFile]


def write_dataset_record(run_root: RunRoot, store: str, sources: DatasetRecord) -> None:
    run_root.write_bytes_atomic(f"{store}/{SOURCES_FILE}", json.dumps(sources.model_dump(), indent=1).encode())


def read_dataset_record(run_root: RunRoot, store: str, fingerprint: str | None = None) -> DatasetRecord | None:
    """The store's record for `fingerprint` (None: whichever it names), once it binds: a part of that fingerprint
    was committed from the files it saw. None when there is none (a hub dataset, a store made before the record
    existed, or one of another fingerprint), it cannot be read, or no part was made yet (a first run that failed
    on a bad line left it: the fixed file is read afresh)."""
    path = f"{store}/{SOURCES_FILE}"
    if not run_root.exists(path):
        return None
    try:
        sources = DatasetRecord.model_validate_json(run_root.read_bytes(path))
    except (ValidationError, ValueError):
        return None
    if fingerprint is not None and sources.fingerprint != fingerprint:
        return None
    return sources if 0 in list_commits(run_root, store, "corpus", sources.fingerprint) else None
