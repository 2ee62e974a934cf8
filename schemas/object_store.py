"""What a run root needs from an object store beyond plain reads and writes: errors in words, one-listing
sizes, ranged and batched reads, and writes that cannot race (mixed into `RunRoot`, kdflow.schemas.storage).

Commit records and leases are created only if absent (`create_if_absent`): on local disk with a hard link,
on S3 with a conditional write (`If-None-Match: *`), and a stale lease is replaced only if unchanged
(`If-Match` on its ETag). Whether a store honours both headers is probed once per process and run root
(AWS S3 does since 2024, and so do MinIO and moto); a store that ignores or refuses them, and every
non-S3 fsspec store, gets the fallback: check, write, then read back. Two writers may then both believe
they won a lease; the commit protocol keeps that harmless, since a shard's bytes are deterministic.
`KDFLOW_CONDITIONAL_WRITES=off` forces the fallback.

Errors of the store itself (no or wrong credentials, access denied, unreachable, no bucket) become one
StoreError line naming the URL and the cause, with secrets from the environment scrubbed from the text.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from kdflow.schemas.disk_space import DiskFull, free_bytes, is_no_space
from kdflow.schemas.errors import KDFlowError, StoreError, StoreUnreachable
from kdflow.schemas.layout import temp_name
from kdflow.schemas.owners import owner_tag

# "off": use the fallback (write, read back) even where S3 has them
CONDITIONAL_WRITES_ENV = "KDFLOW_CONDITIONAL_WRITES"
_CONDITIONAL: dict[str, bool] = {}  # run root URL -> whether its store honours If-None-Match / If-Match (probed once)
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                "ProxyConnectionError", "ClientConnectorError", "ServerDisconnectedError", "ClientOSError"}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError"}


def _scrub(text: str) -> str:
    """`text` without the value of any secret in the environment (keys, tokens, passwords)."""
    for name, value in os.environ.items():
        if len(value) >= 6 and any(word in name.upper() for word in ("SECRET", "TOKEN", "PASSWORD")):
            text = text.replace(value, "***")
    return text


def _unreachable(error: BaseException) -> bool:
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & _UNREACHABLE) or isinstance(error, (ConnectionError, TimeoutError))


def store_error(where: str, error: BaseException) -> StoreError | None:
    """The one-line error for an object-store call that failed because of the store itself, else None."""
    cause = store_cause(error)
    if cause is None:
        return None
    return (StoreUnreachable if _unreachable(error) else StoreError)(f"{where}: {cause}")


def store_cause(error: BaseException) -> str | None:
    """Why an object-store call failed, when the store itself is the cause (credentials, access, network)."""
    names = {cls.__name__ for cls in type(error).__mro__}
    message = _scrub((str(error).strip().splitlines() or [type(error).__name__])[0])
    if names & _NO_CREDENTIALS:
        return (f"no credentials ({message}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                "in the environment of every process")
    if isinstance(error, PermissionError):
        return f"access denied ({message}): check the credentials and the bucket's permissions"
    if _unreachable(error):
        return f"the store is unreachable ({message}); rerun once it is back: committed shards are kept"
    return None


def _precondition_failed(error: BaseException) -> bool:
    """A conditional write refused (HTTP 412): s3fs raises it as OSError(EINVAL) caused by a botocore ClientError."""
    cause = error.__cause__ or error.__context__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code") if cause is not None else None
    return code in ("PreconditionFailed", "412") or (isinstance(error, OSError) and error.errno == errno.EINVAL
                                                     and "condition" in str(error).lower())


class ObjectStoreOps:
    """Mixed into RunRoot, whose `url`, `fs`, `root`, `is_local`, `path`, `display`, `exists`, `read_bytes`,
    `makedirs` and `write_bytes_atomic` it uses."""

    url: str
    fs: Any
    root: str
    is_local: bool

    @contextlib.contextmanager
    def store_errors(self, path: str | None = None) -> Iterator[None]:
        """On object stores, turn errors of the store itself (credentials, access, network, no bucket) into one
        StoreError line naming the URL and the cause; a missing key stays a FileNotFoundError."""
        if self.is_local:
            yield
            return
        try:
            yield
        except KDFlowError:
            raise
        except FileNotFoundError:
            self.check_bucket()
            raise
        except Exception as error:
            failure = store_error(self.display(path) if path else self.url, error)
            if failure is None:
                raise
            raise failure from None

    def check_bucket(self) -> None:
        """Once per run root: a missing bucket is an error, not an empty run root."""
        if getattr(self, "_bucket_ok", False) or self.is_local:
            return
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.info(bucket)
        except FileNotFoundError:
            raise StoreError(f"{self.url}: the bucket {bucket!r} does not exist (create it, or fix run_root)") from None
        except Exception as error:
            failure = store_error(self.url, error)
            if failure is None:
                raise
            raise failure from None
        self._bucket_ok = True

    def list_sizes(self, path: str) -> dict[str, int]:
        """Base name -> size of the files in a folder, from one listing (empty if the folder does not exist)."""
        if self.is_local:
            sizes = {}
            try:
                with os.scandir(path) as entries:
                    for entry in entries:
                        with contextlib.suppress(FileNotFoundError):  # gone since the listing: another writer's
                            if entry.is_file():  # temporary file, renamed (it made the whole listing empty)
                                sizes[entry.name] = entry.stat().st_size
            except FileNotFoundError:
                return {}
            return sizes
        with self.store_errors(path):
            try:
                entries = self.fs.ls(path, detail=True, refresh=True)
            except FileNotFoundError:
                self.check_bucket()
                return {}
            finally:
                self.fs.invalidate_cache(path)  # later size()/exists() calls ask the store, not this listing
        return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in entries
                if e.get("type") == "file"}

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        """Whole small files (records), concurrently on object stores; None for a missing one."""
        if self.is_local:
            out: list[bytes | None] = []
            for path in paths:
                try:
                    with open(path, "rb") as handle:
                        out.append(handle.read())
                except FileNotFoundError:
                    out.append(None)
            return out
        if not paths:
            return []
        with self.store_errors(paths[0]):
            results = self.fs.cat_ranges(list(paths), [0] * len(paths), [None] * len(paths), on_error="return")
        for path, result in zip(paths, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, FileNotFoundError):
                with self.store_errors(path):
                    raise result
        return [None if isinstance(r, BaseException) else bytes(r) for r in results]

    def read_ranges(self, paths: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        """Bytes [start, end) of `paths[i]` for each i: pread on local disk, concurrent ranged GETs on object stores."""
        if self.is_local:
            out, handles = [], {}
            try:
                for path, start, end in zip(paths, starts, ends, strict=True):
                    if path not in handles:
                        handles[path] = open(path, "rb")  # noqa: SIM115 - closed below, once per file
                    out.append(os.pread(handles[path].fileno(), int(end) - int(start), int(start)))
            finally:
                for handle in handles.values():
                    handle.close()
            return out
        if not paths:
            return []
        with self.store_errors(paths[0]):
            return [bytes(b) for b in self.fs.cat_ranges(list(paths), [int(s) for s in starts], [int(e) for e in ends],
                                                         on_error="raise")]

    @property
    def conditional_writes(self) -> bool:
        """Whether the store creates a file only if absent and replaces it only if unchanged, atomically: local disk
        (hard links) and S3 (`If-None-Match: *`, `If-Match`), probed once per process; else the fallback is used."""
        if self.is_local:
            return True
        if self.url not in _CONDITIONAL:
            _CONDITIONAL[self.url] = (os.environ.get(CONDITIONAL_WRITES_ENV, "auto") != "off"
                                      and self._probe_conditional())
        return _CONDITIONAL[self.url]

    def _probe_conditional(self) -> bool:
        if not set(self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)) & {"s3", "s3a"}:
            return False  # other stores: fsspec's generic "create" checks, then writes (not atomic)
        probe = self.path(f"_conditional-probe-{uuid.uuid4().hex[:12]}")
        with self.store_errors(probe):
            try:
                self.fs.pipe_file(probe, b"1", mode="create")
                try:
                    self.fs.pipe_file(probe, b"2", mode="create")
                    return False  # the store ignored If-None-Match
                except FileExistsError:
                    pass
                try:
                    self.fs.pipe_file(probe, b"3", IfMatch='"00000000000000000000000000000000"')
                    return False  # the store ignored If-Match
                except OSError as error:
                    return _precondition_failed(error)
            except (NotImplementedError, TypeError, ValueError):
                return False
            except OSError as error:
                if store_cause(error) is not None:
                    raise
                return False  # e.g. 501 Not Implemented for the header
            finally:
                with contextlib.suppress(Exception):
                    self.fs.rm(probe)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        """Create `path` holding `data` unless it exists; -> whether this call created it. Atomic on local disk and
        on S3; elsewhere (no conditional writes) checked, written, then read back: best effort."""
        if self.is_local:
            folder = os.path.dirname(path)
            self.makedirs(folder)
            # The owner tag in the temporary name: a SIGKILL here leaves a file the next run removes.
            tmp = os.path.join(folder, temp_name(os.path.basename(path), owner_tag(), uuid.uuid4().hex[:12]))
            try:
                with open(tmp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError as error:
                if is_no_space(error):
                    raise DiskFull(path, len(data), free_bytes(folder)) from error
                raise
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
        with self.store_errors(path):
            if self.conditional_writes:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                    return True
                except FileExistsError:
                    return False
            if self.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return self.read_bytes(path) == data

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """A file's bytes and a token of its version (the ETag on object stores; None on local disk)."""
        if self.is_local:
            return self.read_bytes(path), None
        with self.store_errors(path):
            self.fs.invalidate_cache(path)
            token = self.fs.info(path).get("ETag")
            return self.fs.cat_file(path, start=0), token

    def replace_if_unchanged(self, path: str, data: bytes, token: str | None) -> bool:
        """Overwrite `path` only if it still is the version `token` names; -> whether this call wrote it. Without
        conditional writes (or a token): written, then read back."""
        with self.store_errors(path):
            if not self.is_local and token and self.conditional_writes:
                try:
                    self.fs.pipe_file(path, data, IfMatch=token)
                    return True
                except FileNotFoundError:
                    return False
                except OSError as error:
                    if _precondition_failed(error):
                        return False
                    raise
            self.write_bytes_atomic(path, data)
            return self.read_bytes(path) == data
