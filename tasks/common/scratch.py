"""Scratch folders on local disk (a config file for a child process, a staging copy for an upload) that never
outlive the run that made them, even when that run is killed with SIGKILL and runs no cleanup at all.

They live in one folder per user, `$TMPDIR/kdflow-UID/`, named `KIND-PID-HOSTTAG-RANDOM`; a folder is
removed when its `with` block ends, and the next `scratch_dir` call of any kdflow process removes those
whose process is gone (kdflow.schemas.owners).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kdflow.schemas.owners import is_stale, owner_tag
from kdflow.tasks.common.units import MIB

if TYPE_CHECKING:
    from kdflow.schemas.storage import RunRoot

_OWNER_IN_NAME = re.compile(r"-\d+-[0-9a-f]{8}-")


def scratch_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"kdflow-{os.getuid() if hasattr(os, 'getuid') else 'user'}")


def scratch_owner(name: str) -> str | None:
    """The owner tag (`PID-HOSTTAG-...`) in a scratch folder's name `KIND-PID-HOSTTAG-RANDOM` (KIND may hold '-')."""
    match = _OWNER_IN_NAME.search(name)
    return name[match.start() + 1:] if match else None


def remove_stale_scratch(root: str | None = None) -> list[str]:
    """Remove scratch folders of processes that are gone; -> their names."""
    root = root or scratch_root()
    removed = []
    now = time.time()
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        tag = scratch_owner(name)
        path = os.path.join(root, name)
        with contextlib.suppress(FileNotFoundError):
            if is_stale(tag, os.lstat(path).st_mtime, now):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
    return removed


@contextlib.contextmanager
def scratch_dir(kind: str) -> Iterator[str]:
    """A fresh private folder `KIND-OWNER-RANDOM` for the duration of the block (KIND: letters and digits)."""
    root = scratch_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    remove_stale_scratch(root)
    folder = tempfile.mkdtemp(prefix=f"{kind}-{owner_tag()}-", dir=root)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def local_copy(run_root: RunRoot, path: str) -> Iterator[str]:
    """A local folder with the files of `path` for the block: the folder itself on local disk, else a scratch
    copy (a checkpoint to resume from, a student to chat with)."""
    if run_root.is_local:
        yield path
        return
    with scratch_dir("kdflow-download") as local:
        for name in run_root.listdir(path):
            with run_root.store_errors(f"{path}/{name}"):
                run_root.fs.get_file(f"{path}/{name}", os.path.join(local, name))
        yield local


@contextlib.contextmanager
def downloaded_model(url: str, subfolder: str) -> Iterator[str]:
    """A local copy, for the block, of the model folder at `url` on an object store, or of its `subfolder` (a
    student's final/) when `url` holds no config.json itself: transformers loads models from local folders only.
    One line on stderr says what was copied."""
    import sys

    from kdflow.schemas.errors import KDFlowError
    from kdflow.schemas.storage import RunRoot

    store = RunRoot(url.rstrip("/"))
    folder = store.root
    if not store.exists(f"{folder}/config.json") and store.exists(f"{folder}/{subfolder}/config.json"):
        folder = f"{folder}/{subfolder}"
    if "config.json" not in store.listdir(folder):
        raise KDFlowError(f"student {url!r} is not a model: no config.json in {store.display(folder)}")
    with local_copy(store, folder) as local:
        names = os.listdir(local)
        size = sum(os.path.getsize(os.path.join(local, name)) for name in names)
        print(f"kdflow: copied {store.display(folder)} ({len(names)} files, {size / MIB:,.1f} MiB) to {local} for "
              "this session", file=sys.stderr, flush=True)
        yield local
