"""A snapshot's data file read once into memory, region by region, by a reader thread, while
the restore checksums the regions already read: :func:`stage_file`.

The file is mapped read-only; the reader asks the kernel to read ahead
(``posix_fadvise(WILLNEED)``) and pins each region (``mlock``) in order, so that the bytes
checked are the bytes copied. Where ``mlock`` is refused the caller checks each copy again
(:attr:`Staging.pinned` False). Mapped, not O_DIRECT into fresh memory: that was slower on the
2-core VM, where fresh memory faults in at about the disk's rate (docs/benchmarks.md).

Call order (the restore)::

    staged = stage_file(fd, size)          # the reader thread starts
    staged.wait(end)                       # bytes [0, end) are in staged.view
    staged.close()                         # on every path; then the caller closes fd
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading

from swap_state.server import _posix

__all__ = ["Staging", "stage_file"]

STAGE_REGION_BYTES = 16 << 20
"""The reader thread reads (and pins) the file in regions of this size."""
READ_AHEAD_REGIONS = 8
"""Regions the reader asks the kernel to read ahead of the one it pins."""

_mlock = _posix.mlock  # a module name, so that tests can replace it


class Staging:
    """The file's bytes, region by region, in a read-only mapping, read ahead and pinned in order."""

    pinned = True
    """The staged bytes cannot change before the caller copies them (else it checks again)."""
    pin_errno = 0
    """Why they are not pinned (the mlock errno), when they are not."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.address = _posix.mmap_read_only(fd, size)
        self.view = _posix.view_at(self.address, size)
        self._ready: queue.Queue[int | BaseException | None] = queue.Queue()
        self._stop = threading.Event()
        self._upto = 0
        self._thread = threading.Thread(target=self._run, name="restore-stage", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._read()
        except BaseException as exc:  # reported by wait()
            self._ready.put(exc)
        finally:
            self._ready.put(None)

    def _read(self) -> None:
        advised = 0
        for start in range(0, self.size, STAGE_REGION_BYTES):
            if self._stop.is_set():
                return
            length = min(STAGE_REGION_BYTES, self.size - start)
            ahead = min(self.size, start + (READ_AHEAD_REGIONS + 1) * STAGE_REGION_BYTES)
            if advised < ahead:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(self.fd, advised, ahead - advised, os.POSIX_FADV_WILLNEED)
                advised = ahead
            if self.pinned:
                err = _mlock(self.address + start, length)  # reads the region, pins it
                if err:
                    self.pinned, self.pin_errno = False, err
            self._ready.put(start + length)

    def wait(self, end: int) -> None:
        """Until the reader has passed ``end``; its error, if it failed before."""
        while self._upto < end:
            item = self._ready.get()
            if item is None:
                self._upto = self.size
            elif isinstance(item, BaseException):
                raise item
            else:
                self._upto = item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.view.release()
        _posix.munmap(self.address, self.size)  # also unpins


def stage_file(fd: int, size: int) -> Staging:
    """The file open on ``fd`` (``size`` bytes) being staged."""
    return Staging(fd, size)
