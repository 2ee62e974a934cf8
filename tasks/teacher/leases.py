"""Shard leases: a process's claim on a top-K shard it is computing, so that two processes on one run root do
not compute the same shard (a lost race would still be harmless: the commit protocol makes it idempotent).
The mechanism is the common one (kdflow.tasks.common.leases); the names are the store's `shard-NNNNN.lease`."""

from __future__ import annotations

import os

from kdflow.schemas.layout import lease_file_name
from kdflow.schemas.protocol import LEASE_OWNER_ENV
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.leases import Leases


class ShardLeases(Leases):
    """`shard-NNNNN.lease` files (owner, host, pid, expiry) in a top-K store: claims on shards being computed.

    The owner defaults to the flow's task run (LEASE_OWNER_ENV), so that a retry in a new process takes over
    the lease its killed predecessor left."""

    def __init__(self, run_root: RunRoot, store: str, ttl_s: float, owner: str | None = None) -> None:
        super().__init__(run_root, store, ttl_s, owner or os.environ.get(LEASE_OWNER_ENV))

    def file_name(self, shard_id: int) -> str:  # type: ignore[override]
        return lease_file_name(shard_id)
