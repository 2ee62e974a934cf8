"""One trainer per student: rank 0 holds `students/NAME/trainer.lease` while it trains, so that a second run
on the same student (two `kdflow run` at once, a deployment run overlapping a retry) waits for the first to
finish and then resumes from its final checkpoint, which leaves it nothing to do: every step is trained
once and `metrics.jsonl` never holds a step twice.

The lease is the common mechanism (kdflow.tasks.common.leases): a holder that died on this host is taken over
at once, one on another host after `student.lease_ttl_s` without renewal (renewed while training).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from kdflow.schemas.config import StudentConfig
from kdflow.schemas.layout import STUDENTS_DIR, TRAINER_LEASE
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.leases import Leases
from kdflow.tasks.student.distributed import barrier

logger = logging.getLogger("kdflow")


class TrainerLease:
    """The held lease (rank 0) or a stand-in that does nothing (other ranks)."""

    def __init__(self, leases: Leases | None) -> None:
        self.leases = leases

    def renew(self) -> None:
        if self.leases is not None:
            self.leases.renew(TRAINER_LEASE)


class _TrainerLeases(Leases):
    def file_name(self, key: str) -> str:  # type: ignore[override]
        return key


@contextlib.contextmanager
def hold_student(run_root: RunRoot, student: StudentConfig, rank: int = 0,
                 poll_s: float | None = None) -> Iterator[TrainerLease]:
    """Wait until this process (rank 0) holds the student's lease, then train inside the block; every rank
    passes a barrier first, so that no rank reads a checkpoint while another job still writes them."""
    folder = run_root.path(STUDENTS_DIR, student.name)
    leases = _TrainerLeases(run_root, folder, student.lease_ttl_s) if rank == 0 else None
    if leases is not None:
        poll = poll_s if poll_s is not None else min(5.0, student.lease_ttl_s / 10)
        waited_since = None
        while not leases.acquire(TRAINER_LEASE):
            if waited_since is None:
                holder = leases.read(TRAINER_LEASE) or {}
                logger.warning("student %s is being trained by pid %s on %s: waiting for it to finish (then resuming "
                               "from its checkpoint)", student.name, holder.get("pid", "?"), holder.get("host", "?"))
                waited_since = time.monotonic()
            time.sleep(poll)
        if waited_since is not None:
            logger.info("student %s: the other trainer is done after %.0f s of waiting", student.name,
                        time.monotonic() - waited_since)
    barrier()
    try:
        with leases.holding(TRAINER_LEASE) if leases is not None else contextlib.nullcontext():
            yield TrainerLease(leases)
    finally:
        local = run_root.local_path(folder) if leases is not None else None
        if local is not None and not run_root.listdir(folder):  # a run that failed before writing anything (bad
            with contextlib.suppress(OSError):  # settings, missing store) leaves no empty student behind
                os.rmdir(local)
