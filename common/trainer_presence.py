"""Whether a trainer process still has its segment: a shared ``flock`` on the segment file, held
while mapped and dropped by the kernel however the process ends. A server asks before giving an
adopted session to a fresh Attach: a trainer still holding it will reconnect.
"""

from __future__ import annotations

import fcntl
import os

__all__ = ["hold", "held"]


def hold(fd: int) -> None:
    """The trainer's side: a shared lock on ``fd`` (shared: a forked child takes nothing)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def held(path: str | os.PathLike[str]) -> bool:
    """The server's side: whether some process holds the trainer's lock on ``path`` now (never
    blocks; False when the file is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing it drops the exclusive lock, when it was taken
    return False
