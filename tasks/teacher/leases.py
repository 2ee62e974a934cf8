"""Leases: a process's claim on a top-K shard it is computing, so that two processes on one run root do not
compute the same shard (a lost race would still be harmless: the commit protocol makes it idempotent)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from typing import Any

from kdflow.schemas.layout import lease_file_name
from kdflow.schemas.protocol import LEASE_OWNER_ENV
from kdflow.schemas.storage import RunRoot


class ShardLeases:
    """`shard-NNNNN.lease` files (owner, host, pid, expiry) in a store: claims on shards being computed.

    A lease is live while unexpired and, on this host, while its process exists. Local disk: created
    whole with os.link (fails if the file exists); a stale one is renamed away first, so of two processes
    taking it over only one wins. Object stores: conditional writes where the store has them (`_acquire_object`).
    """

    def __init__(self, run_root: RunRoot, store: str, ttl_s: float, owner: str | None = None) -> None:
        self.run_root, self.store, self.ttl_s = run_root, store, ttl_s
        self.owner = owner or os.environ.get(LEASE_OWNER_ENV) or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._renewed: dict[int, float] = {}

    def path(self, shard_id: int) -> str:
        return f"{self.store}/{lease_file_name(shard_id)}"

    def _payload(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires_at": time.time() + self.ttl_s}).encode()

    def read(self, shard_id: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.run_root.read_bytes(self.path(shard_id)))
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

    def acquire(self, shard_id: int) -> bool:
        path = self.path(shard_id)
        if not self.run_root.is_local:
            won = self._acquire_object(path)
        else:
            won = self._acquire_local(path, shard_id)
        if won:
            self._renewed[shard_id] = time.monotonic()
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

    def _acquire_local(self, path: str, shard_id: int) -> bool:
        self.run_root.makedirs(self.store)
        for _ in range(3):
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            try:
                with open(tmp, "wb") as handle:  # inside the try: on a full disk the failed temp file goes too
                    handle.write(self._payload())
                os.link(tmp, path)
                return True
            except FileExistsError:
                if self.held_by_other(self.read(shard_id)):
                    return False
                stale = f"{path}.stale-{uuid.uuid4().hex[:12]}"
                with contextlib.suppress(FileNotFoundError):  # FileNotFoundError: another process moved it first
                    os.rename(path, stale)
                    os.remove(stale)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
        return False

    def renew(self, shard_id: int) -> None:
        """Push the expiry out, at most every ttl/3 seconds (called once per micro-batch)."""
        if time.monotonic() - self._renewed.get(shard_id, 0.0) >= self.ttl_s / 3:
            self.run_root.write_bytes_atomic(self.path(shard_id), self._payload())
            self._renewed[shard_id] = time.monotonic()

    def release(self, shard_id: int) -> None:
        if (self.read(shard_id) or {}).get("owner") == self.owner:
            self.run_root.remove(self.path(shard_id))
        self._renewed.pop(shard_id, None)


