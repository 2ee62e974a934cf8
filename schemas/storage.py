"""The run root on fsspec: one small wrapper so every stage reads and writes the same way.

Local disk: data is written to a temporary file in the destination folder and moved into place with
`os.replace`, so a reader never sees half a file. Object stores: uploads appear whole under their final
key, so the final key is written directly. Either way the commit record is written last (kdflow.schemas.commits).
Conditional writes, ranged and batched reads, object-store errors in words: kdflow.schemas.object_store; a full
disk: kdflow.schemas.disk_space.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kdflow.schemas.disk_space import DiskFull, free_bytes, is_no_space
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import CHECKPOINT_MARKER, checkpoint_step, temp_name, temp_owner
from kdflow.schemas.object_store import ObjectStoreOps
from kdflow.schemas.owners import is_stale, owner_tag

# No leading dot (hidden, `.`, `..`) and no separators; a leading underscore is fine (`_complete.json`).
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


class HashingWriter:
    """A write-only file wrapper that hashes and counts every byte on its way to disk."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._sha = hashlib.sha256()
        self.nbytes = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self._sha.update(view)
        self.nbytes += view.nbytes
        self._raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.nbytes

    def close(self) -> None:
        self.closed = True

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


class RunRoot(ObjectStoreOps):
    """A run root URL (`runs/demo`, `file:///data/kd`, `s3://bucket/kd`) and the file operations on it."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as error:  # fsspec: "Install s3fs to access S3"
            extra = " (kdflow's s3 extra: pip install 'kdflow[s3]')" if url.startswith(("s3://", "s3a://")) else ""
            raise StoreError(f"run root {url}: {error}{extra}") from None
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            self.root = os.path.abspath(self.root)

    def __repr__(self) -> str:
        return f"RunRoot({self.url!r})"

    def path(self, *parts: str) -> str:
        """Join path parts under the root; a part that would escape the root is an error."""
        for part in parts:
            for piece in part.split("/"):
                if not _SAFE_PART.match(piece) or piece in {".", ".."}:
                    raise StoreError(f"unsafe path component {piece!r} in {part!r}: it could escape the run root")
        return posixpath.join(self.root, *parts) if not self.is_local else os.path.join(self.root, *parts)

    def display(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def ensure_writable(self) -> None:
        """Fail early, with one line, if the run root cannot be written."""
        name = temp_name("write-probe", owner_tag(), uuid.uuid4().hex[:8])  # hidden: not a `path()` part
        probe = os.path.join(self.root, name) if self.is_local else posixpath.join(self.root, name)
        try:
            with self.store_errors(self.root):  # credentials and network first: they have their own words
                self.check_bucket()  # s3fs's makedirs would create a mistyped bucket and run there
                self.makedirs(self.root)
                remove_stale_temp_files(self, self.root)  # probes of killed processes
                with self.fs.open(probe, "wb") as handle:
                    handle.write(b"ok")
        except (OSError, PermissionError) as error:
            if is_no_space(error):
                raise DiskFull(self.display(self.root),
                               free=free_bytes(self.root) if self.is_local else None) from error
            raise StoreError(f"run root {self.url!r} cannot be written: {error.strerror or error}") from None
        finally:  # the probe's removal fails too where the write did (no credentials, no store): the write's error
            with contextlib.suppress(Exception):  # is the one to show
                self.fs.rm(probe)

    def makedirs(self, path: str) -> None:
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        else:
            with self.store_errors(path):
                self.fs.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        if self.is_local:
            return os.path.exists(path)
        with self.store_errors(path):
            self.fs.invalidate_cache(path)  # ask the store, not an earlier listing
            found = self.fs.exists(path)
            if not found:
                self.check_bucket()
            return found

    def size(self, path: str) -> int:
        if self.is_local:
            return os.path.getsize(path)
        with self.store_errors(path):
            self.fs.invalidate_cache(path)  # an earlier listing may predate the file
            return int(self.fs.size(path))

    def listdir(self, path: str) -> list[str]:
        """Base names in a folder (empty if the folder does not exist)."""
        try:
            with self.store_errors(path):
                entries = self.fs.ls(path, detail=False, refresh=True) if not self.is_local else os.listdir(path)
        except FileNotFoundError:
            return []
        finally:
            if not self.is_local:
                self.fs.invalidate_cache(path)  # later size()/exists() calls ask the store, not this listing
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    def read_bytes(self, path: str) -> bytes:
        if self.is_local:
            with open(path, "rb") as handle:
                return handle.read()
        with self.store_errors(path):
            return bytes(self.fs.cat_file(path, start=0))  # one ranged GET (no HEAD first)

    def open_read(self, path: str, **options: object) -> IO[bytes]:
        """A file object; on object stores `options` go to fsspec (`block_size`, `cache_type`: bounded caches)."""
        with self.store_errors(path):
            return self.fs.open(path, "rb", **options) if not self.is_local else open(path, "rb")

    def local_path(self, path: str) -> str | None:
        """The OS path when the root is on local disk (for memory-mapping), else None."""
        return path if self.is_local else None

    @contextlib.contextmanager
    def atomic_writer(self, path: str, expected_bytes: int | None = None) -> Iterator[HashingWriter]:
        """Write `path` so that it appears whole or not at all; yields a hashing file object.

        A full disk raises DiskFull naming `path` and about what it needs (`expected_bytes`, when the caller
        knows the size, else at least what was written), after the partial file is removed."""
        folder = posixpath.dirname(path) if not self.is_local else os.path.dirname(path)
        if self.is_local:
            writer: HashingWriter | None = None
            tmp = os.path.join(folder, temp_name(os.path.basename(path), owner_tag(), uuid.uuid4().hex[:8]))
            try:
                self.makedirs(folder)
                with open(tmp, "wb") as raw:
                    writer = HashingWriter(raw)
                    yield writer
                    raw.flush()
                    os.fsync(raw.fileno())
                os.replace(tmp, path)
            except BaseException as error:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
                if is_no_space(error) and not isinstance(error, DiskFull):
                    needed = max(expected_bytes or 0, writer.nbytes if writer is not None else 0)
                    raise DiskFull(path, needed or None, free_bytes(folder)) from error
                raise
        else:
            self.makedirs(folder)
            with self.store_errors(path), self.fs.open(path, "wb") as raw:
                writer = HashingWriter(raw)
                yield writer

    def write_bytes_atomic(self, path: str, data: bytes) -> str:
        with self.atomic_writer(path, expected_bytes=len(data)) as writer:
            writer.write(data)
        return writer.sha256

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError), self.store_errors(path):
            self.fs.rm(path)


def remove_stale_temp_files(run_root: RunRoot, folder: str) -> list[str]:
    """Remove the temporary files (and folders) in `folder` whose writer is gone (kdflow.schemas.owners);
    a live writer's are never touched. Local disk only: object stores get whole uploads, no temp files.
    -> the names removed."""
    if not run_root.is_local:
        return []
    removed = []
    now = time.time()
    for name in run_root.listdir(folder):
        owner = temp_owner(name)
        if owner is None:
            continue
        path = os.path.join(folder, name)
        try:
            mtime = os.lstat(path).st_mtime
        except FileNotFoundError:
            continue
        if is_stale(owner, mtime, now):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            removed.append(name)
    return removed


def sha256_of(run_root: RunRoot, path: str, block: int = 8 << 20) -> str:
    sha = hashlib.sha256()
    with run_root.open_read(path) as handle:
        while chunk := handle.read(block):
            sha.update(chunk)
    return sha.hexdigest()


def complete_checkpoint_steps(run_root: RunRoot, student_dir: str) -> list[int]:
    """The steps of a student's complete checkpoints (those with their marker, the ones a rerun resumes from),
    oldest first, without reading the markers (the training's own listing reads and checks them)."""
    return sorted(step for name in run_root.listdir(student_dir) if (step := checkpoint_step(name)) is not None
                  and run_root.exists(f"{student_dir}/{name}/{CHECKPOINT_MARKER}"))
