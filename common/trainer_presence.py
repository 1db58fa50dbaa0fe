"""Whether a trainer process still has its segment: a shared ``flock`` on the segment file.

The trainer holds it while mapped (:func:`hold`); the kernel drops it however the process ends.
A server that adopted a session asks :func:`held` before giving it to a fresh Attach: a trainer
still holding it will reconnect, and its state must not go to another run meanwhile.
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
