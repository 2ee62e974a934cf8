"""Leases: a process's claim on work in the run root (a top-K shard it computes, a student it trains), so that
two processes on one run root do not do the same work at once.

A lease file holds its owner, host, pid and expiry. It is live while unexpired and, on this host, while its
process exists: a lease of a process that died on this host is taken over at once, one from another host
once it expires (its owner renews it while working). Local disk: created whole with os.link (fails if the
file exists); a stale one is renamed away first, so of two processes taking it over only one wins. Object
stores: created only if absent and taken over only if unchanged (S3 conditional writes), with the fallback
write-then-read-back where a store has none (kdflow.schemas.object_store).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Hashable, Iterator
from typing import Any

from kdflow.schemas.layout import temp_name
from kdflow.schemas.owners import owner_tag
from kdflow.schemas.storage import RunRoot


class Leases:
    """Lease files in one folder, one per key; `file_name(key)` names them (subclasses choose the names)."""

    def __init__(self, run_root: RunRoot, folder: str, ttl_s: float, owner: str | None = None) -> None:
        self.run_root, self.store, self.ttl_s = run_root, folder, ttl_s
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._renewed: dict[Hashable, float] = {}

    def file_name(self, key: Hashable) -> str:
        return f"{key}.lease"

    def path(self, key: Hashable) -> str:
        return f"{self.store}/{self.file_name(key)}"

    def _payload(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires_at": time.time() + self.ttl_s}).encode()

    def read(self, key: Hashable) -> dict[str, Any] | None:
        try:
            return json.loads(self.run_root.read_bytes(self.path(key)))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # unreadable: treated as expired

    def held_by_other(self, lease: dict[str, Any] | None) -> bool:
        if not lease or lease.get("owner") == self.owner or lease.get("expires_at", 0) < time.time():
            return False
        if lease.get("host") == socket.gethostname():
            try:
                os.kill(int(lease["pid"]), 0)
            except ProcessLookupError:
                return False  # its process died on this host: no need to wait for the expiry
            except (PermissionError, KeyError, ValueError, TypeError):
                pass
        return True

    def acquire(self, key: Hashable) -> bool:
        path = self.path(key)
        if not self.run_root.is_local:
            won = self._acquire_object(path)
        else:
            won = self._acquire_local(path, key)
        if won:
            self._renewed[key] = time.monotonic()
        return won

    def _acquire_object(self, path: str) -> bool:
        """Object stores: created only if absent; a lease in the way is taken over only if its owner is gone and
        only if unchanged since it was read (S3 If-Match), so of two processes taking it over one wins. Stores
        without conditional writes: written, then read back (kdflow.schemas.object_store)."""
        payload = self._payload()
        if self.run_root.create_if_absent(path, payload):
            return True
        try:
            raw, version = self.run_root.read_versioned(path)
        except FileNotFoundError:  # released in between
            return self.run_root.create_if_absent(path, payload)
        try:
            lease = json.loads(raw)
        except ValueError:
            lease = {}  # unreadable: treated as expired
        if self.held_by_other(lease):
            return False
        return self.run_root.replace_if_unchanged(path, payload, version)

    def _acquire_local(self, path: str, key: Hashable) -> bool:
        self.run_root.makedirs(self.store)
        name = self.file_name(key)
        for _ in range(3):
            # Temporary names carry this process's owner tag: a SIGKILL between these lines leaves a file that
            # the next run removes (kdflow.schemas.storage.remove_stale_temp_files).
            tmp = f"{self.store}/{temp_name(name, owner_tag(), uuid.uuid4().hex[:8])}"
            try:
                with open(tmp, "wb") as handle:  # inside the try: on a full disk the failed temp file goes too
                    handle.write(self._payload())
                os.link(tmp, path)
                return True
            except FileExistsError:
                if self.held_by_other(self.read(key)):
                    return False
                stale = f"{self.store}/{temp_name(name, owner_tag(), uuid.uuid4().hex[:8])}"
                with contextlib.suppress(FileNotFoundError):  # FileNotFoundError: another process moved it first
                    os.rename(path, stale)
                    os.remove(stale)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
        return False

    def renew(self, key: Hashable) -> None:
        """Push the expiry out, at most every ttl/3 seconds (call it as often as convenient)."""
        if time.monotonic() - self._renewed.get(key, 0.0) >= self.ttl_s / 3:
            self.run_root.write_bytes_atomic(self.path(key), self._payload())
            self._renewed[key] = time.monotonic()

    def release(self, key: Hashable) -> None:
        if (self.read(key) or {}).get("owner") == self.owner:
            self.run_root.remove(self.path(key))
        self._renewed.pop(key, None)

    @contextlib.contextmanager
    def holding(self, key: Hashable) -> Iterator[None]:
        """Release the (acquired) lease on the way out. When the body failed, a release that fails too (the store
        that broke the body is often why) is dropped: the body's error is the one to report, and the lease lapses
        after its ttl."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.release(key)
            raise
        self.release(key)
