"""The files of a snapshot being written: :class:`SnapshotFile` (one new file of a partial
snapshot, ``O_EXCL``, optionally O_DIRECT), :func:`write_durable` and :func:`pwrite_all`.
Where they go, and the commit that publishes them: :class:`~swap_state.server.snapshot.tiers.directory.SnapshotDirectory`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib

from swap_state.server import _posix

__all__ = ["SnapshotFile", "pwrite_all", "write_durable"]

# Snapshots, their job directories and the lock are the server user's alone, whatever the
# umask or the root directory's mode (a shared /snapshots, a hostPath).
FILE_MODE = 0o600
DIR_MODE = 0o700


def write_durable(path: pathlib.Path, data: bytes) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it."""
    with SnapshotFile(path, direct=False) as file, memoryview(data) as view:
        pwrite_all(file.fileno(), view, 0)
        file.fsync()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``data`` is at ``offset`` (it may write short); releases the GIL."""
    done = 0
    while done < data.nbytes:
        with data[done:] as rest:
            done += os.pwrite(fd, rest, offset + done)


class SnapshotFile(contextlib.AbstractContextManager):
    """One new file of a partial snapshot directory (``O_EXCL``), open for writing (and reading: a file in memory
    may be mapped, :meth:`.sink.BufferedSink.map`); a context
    manager. Its bytes are durable once :meth:`fsync` returned."""

    def __init__(self, path: pathlib.Path, direct: bool = True, spare: bool = False):
        """``direct``: :meth:`open_direct` may give an O_DIRECT descriptor (``--direct-io``);
        ``spare``: the file exists, a removed step's, to be written over (:mod:`..tiers.spares`)."""
        self.path, self.direct = path, direct
        create = 0 if spare else os.O_CREAT | os.O_EXCL
        self._fd: int | None = os.open(path, os.O_RDWR | create | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        self.in_memory = _posix.in_memory(self._fd)  # on tmpfs: memory-only snapshots, replicas

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        return self._fd

    def open_direct(self) -> int | None:
        """A second descriptor of this file with ``O_DIRECT`` (the caller closes it); None where ``--direct-io`` or the
        filesystem refuses it (EINVAL: some network filesystems), and on tmpfs (memory-only snapshots, replicas): it
        takes O_DIRECT since Linux 6.6, but its pages are memory, so a bounce buffer would only add a copy."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag or not self.direct or self.in_memory:
            return None
        try:
            return os.open(self.path, os.O_WRONLY | flag | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None
            raise

    def fsync(self) -> None:
        os.fsync(self.fileno())

    def close(self) -> None:
        """Release the descriptor (idempotent); does not make anything durable."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __exit__(self, *exc_info: object) -> None:
        self.close()
