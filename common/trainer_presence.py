"""Whether a trainer process still has its segment: a shared ``flock`` on the segment file.

The trainer takes it when it maps its segment and keeps that file open while mapped
(:func:`hold`); the kernel drops it when the process ends, however it ends (SIGKILL, OOM). A
server that adopted a session from its predecessor asks :func:`held` before it gives that
session to a fresh Attach: a trainer still holding it reconnects by itself, and its state must
not go to another run meanwhile. Works wherever the two processes share the file (one host's
/dev/shm, a container sharing the server's IPC namespace).
"""

from __future__ import annotations

import fcntl
import os

__all__ = ["hold", "held"]


def hold(fd: int) -> None:
    """The trainer's side: a shared lock on ``fd`` (the segment file, kept open while mapped).
    Shared, so a forked child that inherits the file takes nothing from its parent."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def held(path: str | os.PathLike[str]) -> bool:
    """The server's side: whether some process holds the trainer's lock on ``path`` now.
    False when the file is gone. Never blocks; nothing is kept locked."""
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
