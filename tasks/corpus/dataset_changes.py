"""The dataset's files now against what materialise read (`corpus/_sources.json`, kdflow.schemas.dataset_record).

`snapshot` records them before materialise writes a store's first part; `changes` names what differs since:
a file added or removed, another size, other bytes (a local file whose modification time moved is hashed again,
so a copy or a `touch` with the same bytes is no change), another version on an object store. `check_unchanged`
turns a difference into one line, for pre-flight and for materialise itself (a run started from a deployment).
A corpus store that materialise had not finished is another matter: nothing was made from it yet (tokenise reads
a finished one only), so a change there (the fix of a record that stopped it) has materialise start it again.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from kdflow.schemas.config import DatasetConfig
from kdflow.schemas.dataset_record import DatasetRecord, RecordedFile
from kdflow.schemas.errors import ConfigError
from kdflow.tasks.corpus.dataset_files import SAVED, file_builder

SHOWN = 3  # changes named in the line; the rest are counted
logger = logging.getLogger(__name__)


def listed_files(dataset: DatasetConfig) -> list[str] | None:
    """Every file the dataset reads (a saved dataset's folder: each file in it); None for a hub dataset."""
    found = file_builder(dataset)
    if found is None:
        return None
    builder, names = found
    if builder == SAVED:
        folder = names[0]
        return sorted(os.path.join(root, name) for root, _, files in os.walk(folder) for name in files)
    listed: list[str] = []
    for name in names:
        if "://" not in name:
            listed.append(name)
            continue
        fs, path = _filesystem(name)
        matches = fs.glob(path) if any(c in path for c in "*?[") else [path]
        listed.extend(fs.unstrip_protocol(match) for match in sorted(matches))
    return listed


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)


def _sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _describe(name: str, hashed: bool) -> RecordedFile:
    if "://" not in name:
        stat = os.stat(name)
        return RecordedFile(name=name, size=stat.st_size, mtime_ns=stat.st_mtime_ns,
                          sha256=_sha256(name) if hashed else None)
    fs, path = _filesystem(name)
    info = fs.info(path)
    version = next((info[key] for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created")
                    if info.get(key) is not None), None)
    return RecordedFile(name=name, size=int(info.get("size") or 0), version=None if version is None else str(version))


def snapshot(dataset: DatasetConfig, fingerprint: str) -> DatasetRecord | None:
    """The record of the dataset's files (local ones hashed); None for a hub dataset or files that cannot be
    listed (the read that follows names the problem)."""
    try:
        names = listed_files(dataset)
        if names is None:
            return None
        return DatasetRecord(fingerprint=fingerprint, files=[_describe(name, hashed=True) for name in names])
    except (ConfigError, OSError, ImportError, ValueError):
        return None


def changes(recorded: DatasetRecord, dataset: DatasetConfig) -> list[str]:
    """What differs between the record and the files now, one phrase each; [] when nothing does, or when none of
    the files can be found (a corpus store that is complete does not need its source)."""
    try:
        return _compare(recorded, listed_files(dataset))
    except (ConfigError, OSError, ImportError, ValueError):
        return []


def recorded_changes(recorded: DatasetRecord) -> list[str]:
    """What differs for the files the record names, found where they are named (a relative path from the working
    folder); without the dataset config, an added file cannot be seen. For `kdflow status`."""
    try:
        before = {item.name: item for item in recorded.files}
        present = [name for name in before if _exists(name)]
        gone = [f"{name} removed" + ("" if os.path.isabs(name) or "://" in name
                                     else f" (or not found from {os.getcwd()})")
                for name in before if name not in present]
        return _differences(before, present) + gone
    except (OSError, ImportError, ValueError):
        return []


def _exists(name: str) -> bool:
    if "://" not in name:
        return os.path.exists(name)
    fs, path = _filesystem(name)
    return bool(fs.exists(path))


def _compare(recorded: DatasetRecord, names: list[str] | None) -> list[str]:
    """The record against the files `names` (those listed now), one phrase a difference; [] for no names."""
    if not names:
        return []
    before = {item.name: item for item in recorded.files}
    now = set(names)
    return _differences(before, names) + [f"{name} removed" for name in before if name not in now]


def _differences(before: dict[str, RecordedFile], names: list[str]) -> list[str]:
    """Each of `names` against its record in `before`: added, another size, other bytes, another version."""
    found: list[str] = []
    for name in names:
        if name not in before:
            found.append(f"{name} added")
            continue
        old, new = before[name], _describe(name, hashed=False)
        if new.size != old.size:
            found.append(f"{name}: {old.size:,} -> {new.size:,} bytes")
        elif new.mtime_ns is not None and new.mtime_ns != old.mtime_ns and old.sha256 is not None:
            if _sha256(name) != old.sha256:
                found.append(f"{name}: other bytes, same size")
        elif new.version is not None and old.version is not None and new.version != old.version:
            found.append(f"{name}: another version ({old.version} -> {new.version})")
    return found


def with_current_times(recorded: DatasetRecord) -> DatasetRecord:
    """The record with each local file's modification time as it is now: after `check_unchanged` passed, the bytes
    are the recorded ones, so a moved time (a copy, a `touch`) is hashed once, not on every later run."""
    files = [item.model_copy(update={"mtime_ns": os.stat(item.name).st_mtime_ns})
             if item.mtime_ns is not None and os.path.exists(item.name) else item for item in recorded.files]
    return recorded.model_copy(update={"files": files})


def shown_changes(found: list[str]) -> str:
    return ", ".join(found[:SHOWN]) + (f" and {len(found) - SHOWN} more" if len(found) > SHOWN else "")


def starts_again(recorded: DatasetRecord, dataset: DatasetConfig, store: str, parts: int) -> bool:
    """For a corpus store that materialise had not finished: whether its files changed since it started, in which
    case its `parts` committed parts are read again (said in a warning); False: nothing changed, it resumes."""
    found = changes(recorded, dataset)
    if found:
        logger.warning("materialise: the dataset's files changed since materialise started reading them into %s "
                       "(%s), and it had not finished: its %d committed %s read again from the files as they are "
                       "now", store, shown_changes(found), parts, "part is" if parts == 1 else "parts are")
    return bool(found)


def check_unchanged(recorded: DatasetRecord | None, dataset: DatasetConfig, store: str) -> None:
    """ConfigError naming what changed since materialise read the files into `store`, if anything did."""
    found = changes(recorded, dataset) if recorded is not None else []
    if found:
        raise ConfigError(changed_files_refusal(found, store))


def changed_files_refusal(found: list[str], store: str) -> str:
    """Why a run with materialise refuses the files' changes `found` (`changes`) since they were read into `store`."""
    return (f"the dataset's files changed since materialise read them into {store} ({shown_changes(found)}): this run "
            "root's stores hold the old text and a rerun would not read the change; put the files back as they were, "
            "or give the changed corpus a new run_root")


def sources_state(run_root: Any) -> str | None:
    """What `kdflow status` and `kdflow validate` say of `corpus/_sources.json`: its files as materialise read them,
    none of them here, or what changed since and what the next run does about it; None where there is no record."""
    from kdflow.schemas.commits import read_complete
    from kdflow.schemas.dataset_record import read_dataset_record
    from kdflow.schemas.layout import CORPUS_DIR

    store = run_root.path(CORPUS_DIR)
    try:
        recorded = read_dataset_record(run_root, store)
    except OSError:
        return None
    if recorded is None:
        return None
    found = recorded_changes(recorded)
    files = f"{len(recorded.files)} file{'' if len(recorded.files) == 1 else 's'}"
    if not found:
        return f"{files} as materialise read them"
    if len(found) == len(recorded.files) and all(" removed" in change for change in found):  # as pre-flight
        return f"{files}, none found here (a complete corpus store does not need them)"
    done = read_complete(run_root, store)
    if done is None or done.fingerprint != recorded.fingerprint:
        return (f"{files}, CHANGED since materialise started reading them: {shown_changes(found)}; it had not "
                "finished, so the next run reads them again from the start")
    return (f"{files}, CHANGED since materialise read them: {shown_changes(found)}; the next run with materialise "
            "refuses (put the files back, or give the changed corpus a new run_root)")


def replaced_store_warning(run_root: Any, store: str, fingerprint: str, dataset: DatasetConfig) -> str | None:
    """The warning for a run about to replace a finished corpus store of another dataset (or other dataset settings):
    the token and top-K stores and students made from it stop matching. Read before the run's own config is written
    beside the store, whose old one names the settings that changed (`dataset` is this run's); None when there is
    nothing to replace."""
    from kdflow.schemas.commits import read_complete
    from kdflow.schemas.config_io import saved_config, setting_changes

    try:
        done = read_complete(run_root, store)
    except Exception:  # noqa: BLE001 - an unreadable record: the stage itself says what it finds
        return None
    if done is None or done.fingerprint == fingerprint:
        return None
    try:
        was, now = saved_config(run_root, store).dataset.model_dump(mode="json"), dataset.model_dump(mode="json")
        changes = setting_changes([(f"dataset.{key}", value, now.get(key)) for key, value in was.items()])
        what = f" ({'; '.join(changes)})" if changes else f" (dataset.path {was['path']!r})"
    except Exception:  # noqa: BLE001 - no config beside it, or one of another kdflow: said without the settings
        what = ""
    return (f"materialise: {run_root.display(store)} holds a finished corpus of another dataset or other dataset "
            f"settings{what}; this run replaces it, and the token store, top-K stores and students made from it stop "
            "matching this run root's corpus (a new run_root keeps both)")
