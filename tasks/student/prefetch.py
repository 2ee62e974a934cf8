"""Batches of the next optimiser steps, assembled in a background thread while the current step computes.

The data order is fixed by the position alone (kdflow.tasks.student.data), so the loader knows which rows
the next steps need and reads them ahead: a step then waits only if reading a batch takes longer than
computing one. One worker thread keeps at most `depth` steps of batches ready (that bounds the loader's
memory); on CUDA they sit in page-locked memory so that the copy to the GPU does not block. How long each
step waited is measured, and the training log reports it as a fraction of the step time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Batches = TypeVar("Batches")


class Prefetcher(Generic[Batches]):
    """`get(key)` returns `make(key)`, computed ahead in one background thread for the keys announced with it."""

    def __init__(self, make: Callable[[int], Batches], depth: int) -> None:
        self.make, self.depth = make, depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdflow-prefetch") if depth > 0 else None
        self._pending: dict[int, Future[Batches]] = {}

    def get(self, key: int, upcoming: list[int]) -> tuple[Batches, float]:
        """-> (make(key), seconds this call waited for it); then starts making the first `depth` of `upcoming`."""
        started = time.perf_counter()
        future = self._pending.pop(key, None)
        for stale in [k for k in self._pending if k not in upcoming]:  # keys that will not be asked for any more
            self._pending.pop(stale).cancel()
        if self._pool is not None:  # schedule before waiting: the next keys start as soon as this one is done
            for next_key in upcoming[: self.depth]:
                if next_key not in self._pending and next_key != key:
                    self._pending[next_key] = self._pool.submit(self.make, next_key)
        result = future.result() if future is not None else self.make(key)
        return result, time.perf_counter() - started

    def close(self) -> None:
        """Stop the thread; batches being read are finished and dropped (bounded: at most one)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
