"""Who made a file: the process and host that temporary names, scratch folders and leases carry.

A writer that is killed (SIGKILL, a reboot) leaves its temporary file behind. The next run of that stage
removes such leftovers, but must never remove a file a live writer is still filling (a second run on the
same run root). So every temporary name carries an owner tag, `PID-HOSTTAG`: on this host a leftover is
stale once its process is gone; from another host (a shared filesystem) once it has not been touched for
`FOREIGN_STALE_AFTER_S` (a live writer keeps its file's mtime fresh).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time

FOREIGN_STALE_AFTER_S = 6 * 3600.0
_TAG = re.compile(r"^(\d+)-([0-9a-f]{8})(?:-|$)")


def host_tag(host: str | None = None) -> str:
    """8 hex characters naming a host (hostnames may hold characters a file name should not)."""
    return hashlib.sha1((host or socket.gethostname()).encode()).hexdigest()[:8]


def owner_tag() -> str:
    """`PID-HOSTTAG` of this process (computed per call: a forked child has its own pid)."""
    return f"{os.getpid()}-{host_tag()}"


def parse_owner_tag(text: str) -> tuple[int, str] | None:
    """(pid, host tag) from a text that starts with an owner tag, else None."""
    match = _TAG.match(text)
    return (int(match.group(1)), match.group(2)) if match else None


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def is_stale(tag_text: str | None, mtime: float | None, now: float | None = None) -> bool:
    """Whether a leftover whose name carries `tag_text` (None: no owner tag, an older kdflow) can go.

    This host's: iff its process is gone. Another host's, or without a tag: iff untouched for a long time."""
    owner = parse_owner_tag(tag_text) if tag_text else None
    if owner is not None and owner[1] == host_tag():
        return owner[0] != os.getpid() and not process_alive(owner[0])
    age = (now if now is not None else time.time()) - (mtime if mtime is not None else 0.0)
    return age > FOREIGN_STALE_AFTER_S
