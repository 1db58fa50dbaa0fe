"""Data files of removed steps kept for new ones to be written over, in a directory in memory (this host's
memory-only snapshots, the replicas it holds): on tmpfs a fresh page costs its allocation and zeroing
(docs/benchmarks.md, "Replicas in a peer's memory").

A restore that maps such a file, and the sink that writes it, hold a shared ``flock`` on it (:func:`hold_for_reading`);
a file is taken for reuse only under an exclusive one, so none is written over while read or written.

A sink's mapping of a file (:meth:`SpareFiles.mapping`) is kept while the file lives, whether listed in a step or
spare: its next writer finds every page mapped already (mapping 512 MiB afresh cost about as much as the copy the
mapping saves, docs/benchmarks.md "One copy of each byte on each host"). A removed file's mapping goes at the next
:meth:`SpareFiles.unmap_removed`, which frees its memory.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import mmap
import os
import pathlib
import shutil
import threading

from swap_state.common.snapshot_errors import SnapshotCorruptError
from swap_state.server import _posix

__all__ = ["SPARE_DIR_NAME", "SpareFiles", "hold_for_reading"]

SPARE_DIR_NAME = ".spare"  # under the directory's root: never a job id, so never listed


class SpareFiles:
    """Removed data files, oldest first, at most ``limit_bytes`` of them (None: those of the
    last removal only); thread-safe."""

    def __init__(self, root: pathlib.Path, limit_bytes: int | None = None):
        self.folder, self.limit_bytes = root / SPARE_DIR_NAME, limit_bytes
        shutil.rmtree(self.folder, ignore_errors=True)  # a previous server's: nothing lists them
        self.folder.mkdir(mode=0o700)
        self._files: collections.OrderedDict[pathlib.Path, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._mappings: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}  # (device, inode): (a descriptor, mapping)

    def mapping(self, fd: int, nbytes: int) -> mmap.mmap:
        """``fd``'s file, ``nbytes`` long (its size), mapped shared and writable: the one kept for it where its size is
        the same, else a new one (every page mapped now: one call, not a fault per page), kept until the file is
        removed. Its writer has it alone (a file is never written twice at once)."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        with self._lock:
            kept = self._mappings.get(key)
        if kept is not None and len(kept[1]) == nbytes:
            return kept[1]
        # Its own open file description, not the sink's (mmap keeps a duplicate of the descriptor it is given): the
        # sink's holds the shared flock that keeps the file from being taken as a spare, until the sink closes it.
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(own, nbytes)
        except BaseException:
            os.close(own)
            raise
        _posix.populate_write(_posix.buffer_address(mapping), nbytes)
        with self._lock:
            self._mappings[key] = (own, mapping)  # the descriptor tells when the file is gone
        if kept is not None:
            self._unmap([kept])
        return mapping

    def unmap_removed(self) -> None:
        """Unmap the files removed since (unlinked: their memory is freed once unmapped)."""
        with self._lock:
            gone = [key for key, (fd, _) in self._mappings.items() if os.fstat(fd).st_nlink == 0]
            removed = [self._mappings.pop(key) for key in gone]
        self._unmap(removed)

    def _unmap(self, kept: list[tuple[int, mmap.mmap]]) -> None:
        for fd, mapping in kept:
            os.close(fd)
            try:
                mapping.close()
            except BufferError:  # a piece still held (a sink being closed): unmapped with its last view
                pass

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._files.values())

    def keep(self, paths: list[pathlib.Path]) -> None:
        """Take ``paths`` (of a step being removed) as spares: each renamed away unless a reader
        holds it (then left to be removed with its step); the oldest dropped past the limit."""
        kept = {}
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: read or written now
                spare = self.folder / str(next(self._numbers))  # a count's next is atomic (the GIL)
                os.rename(path, spare)
                kept[spare] = os.fstat(fd).st_size
            except OSError:
                pass  # removed with its step, never written over
            finally:
                os.close(fd)
        with self._lock:
            stale = list(self._files) if self.limit_bytes is None else []
            for path in stale:
                del self._files[path]
            self._files.update(kept)
            while self.limit_bytes is not None and sum(self._files.values()) > self.limit_bytes:
                stale.append(self._files.popitem(last=False)[0])
        for path in stale:
            path.unlink(missing_ok=True)
        self.unmap_removed()

    def largest(self) -> int:
        """Bytes of the largest spare (the one :meth:`take` gives next), 0 without one."""
        with self._lock:
            return max(self._files.values(), default=0)

    def drop(self, keep_largest: bool = False) -> None:
        """Remove every spare (their memory is needed), or every one but the largest."""
        with self._lock:
            largest = max(self._files, key=self._files.__getitem__, default=None) if keep_largest else None
            stale = [path for path in self._files if path != largest]
            for path in stale:
                del self._files[path]
        for path in stale:
            path.unlink(missing_ok=True)
        self.unmap_removed()

    def take(self, path: pathlib.Path) -> bool:
        """Whether the largest spare now lies at ``path`` (renamed there), to be written over: its
        bytes are stale until written (the writer cuts it to its size)."""
        with self._lock:
            spare = max(self._files, key=self._files.__getitem__, default=None)
            if spare is not None:
                del self._files[spare]
        if spare is None:
            return False
        try:
            os.rename(spare, path)
            return True
        except OSError:
            return False


def hold_for_reading(fd: int, path: pathlib.Path) -> None:
    """A shared ``flock`` on ``fd`` (released when it closes), so :meth:`SpareFiles.keep` leaves the
    file alone; SnapshotCorruptError when ``path`` no longer names the file (taken as a spare)."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        raise SnapshotCorruptError(f"{path} was removed while being restored: restore again")
