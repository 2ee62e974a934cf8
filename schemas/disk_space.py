"""A full disk, told in words: whether an error comes from one, the free space where a stage writes, and the
`DiskFull` error that names the place, what it needed and what was free.

Both the run root's file operations (kdflow.schemas.storage) and its conditional writes
(kdflow.schemas.object_store) raise it, so it lives below both.
"""

from __future__ import annotations

import errno
import os
import shutil

from kdflow.schemas.errors import StoreError


def is_no_space(error: BaseException | None) -> bool:
    """Whether a full disk (or quota) is behind an error, looking down its causes and contexts."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def free_bytes(path: str) -> int | None:
    """Free space of the local filesystem that holds `path` (or would: its nearest existing folder)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.0f}" if nbytes >= 10e6 else f"{max(nbytes / 1e6, 0.1):.1f}"


class DiskFull(StoreError, OSError):
    """No space left where a stage writes: names the place, what it needed and what was free. What was being
    written is removed, committed work is kept, so freeing space and rerunning resumes. An OSError with errno
    ENOSPC too, so whatever handles a full disk (the worker's exit code 3) handles this one."""

    def __init__(self, path: str, needed_bytes: int | None = None, free: int | None = None, hint: str = "") -> None:
        self.path, self.needed_bytes = path, needed_bytes
        room = [f"needs about {_megabytes(needed_bytes)} MB"] if needed_bytes else []
        if free is not None:
            room.append(f"{_megabytes(free) if free else 0} MB free")
        self.free, self.hint = free, hint
        super().__init__(f"disk full at {path}" + (f" ({', '.join(room)})" if room else "") + hint
                         + "; free space there and rerun to resume: committed work is kept")
        self.errno = errno.ENOSPC

    def needing(self, nbytes: int | None, hint: str = "") -> DiskFull:
        """The same error with a better estimate of what the whole write needs (and a hint), for `raise ... from`."""
        return DiskFull(self.path, max(nbytes or 0, self.needed_bytes or 0) or None, self.free, hint or self.hint)
