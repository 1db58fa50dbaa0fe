"""A snapshot's data file read once into memory, region by region, by a reader thread, while
the restore checksums the regions already read: :func:`stage_file`.

Two ways, the first the filesystem allows:

- :class:`DirectStaging`: ``O_DIRECT`` reads into private, page-aligned anonymous memory,
  ``READS_IN_FLIGHT`` at once. The page cache is bypassed (no second copy of the file in
  memory, no readahead heuristics: measured here, O_DIRECT reads ran at 1.6-2.0 GB/s where
  buffered cold reads of the same file were slower), and the staged bytes are a private copy:
  a file changed after it was read cannot change them.
- :class:`MappedStaging`: a read-only mapping of the file whose regions are read ahead
  (``posix_fadvise(WILLNEED)``) and pinned (``mlock``); where ``mlock`` is refused the pages
  may be evicted and read again from a file that changed, so the caller checks each copy
  again (:attr:`Staging.pinned` False).

Call order (the restore)::

    fd, direct = open_for_staging(path)    # O_DIRECT where the filesystem takes it
    staged = stage_file(fd, size, direct=direct)  # the reader thread starts
    staged.wait(end)                       # bytes [0, end) are in staged.view
    ...                                    # checksum them; copy from staged.address
    staged.close()                         # on every path; then the caller closes fd
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from swap_state.server import _posix

__all__ = ["DirectStaging", "MappedStaging", "Staging", "open_for_staging", "stage_file"]

STAGE_REGION_BYTES = 16 << 20
"""The reader thread reads (and pins) the file in regions of this size."""
READ_AHEAD_REGIONS = 8
"""Mapped: regions the reader asks the kernel to read ahead of the one it pins."""
READS_IN_FLIGHT = 2
"""Direct: regions being read at once."""
BLOCK_BYTES = 4096
"""O_DIRECT alignment of offsets, lengths and memory."""

_mlock = _posix.mlock  # a module name, so that tests can replace it


class Staging:
    """The file's bytes, region by region, in memory. Subclasses override :meth:`_read`
    (the reader thread's body: :meth:`_passed` after each region, in order) and
    :meth:`_release`, not :meth:`wait` or :meth:`close`."""

    pinned = True
    """The staged bytes cannot change before the caller copies them (else it checks again)."""
    pin_errno = 0
    """Why they are not pinned (the mlock errno), when they are not."""

    def __init__(self, fd: int, size: int, address: int):
        self.fd, self.size, self.address = fd, size, address
        self.view = _posix.view_at(address, size)
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
        raise NotImplementedError

    def _passed(self, end: int) -> None:
        self._ready.put(end)

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
        self._release()

    def _release(self) -> None:
        raise NotImplementedError


class MappedStaging(Staging):
    """A read-only mapping of the file, regions read ahead and pinned in order."""

    def __init__(self, fd: int, size: int):
        super().__init__(fd, size, _posix.mmap_read_only(fd, size))

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
            self._passed(start + length)

    def _release(self) -> None:
        _posix.munmap(self.address, self.size)  # also unpins


class DirectStaging(Staging):
    """O_DIRECT reads of the file (``direct_fd``, the caller's) into anonymous memory."""

    def __init__(self, direct_fd: int, size: int):
        self._memory = mmap.mmap(-1, max(BLOCK_BYTES, -(-size // BLOCK_BYTES) * BLOCK_BYTES))
        self._whole = memoryview(self._memory)
        super().__init__(direct_fd, size, _posix.buffer_address(self._memory))

    def _read_region(self, start: int) -> int:
        """Read the region at ``start`` (its length rounded up to a block: the file's end
        may fall inside it); the bytes read."""
        length = min(STAGE_REGION_BYTES, len(self._memory) - start)
        done = 0
        while done < length:
            with self._whole[start + done : start + length] as into:
                got = os.preadv(self.fd, [into], start + done)
            if got <= 0:
                break
            done += got
        return done

    def _read(self) -> None:
        regions = deque(range(0, self.size, STAGE_REGION_BYTES))
        in_flight: deque[tuple[int, Future[int]]] = deque()
        with ThreadPoolExecutor(READS_IN_FLIGHT, thread_name_prefix="restore-read") as pool:
            while regions or in_flight:
                while regions and len(in_flight) < READS_IN_FLIGHT and not self._stop.is_set():
                    start = regions.popleft()
                    in_flight.append((start, pool.submit(self._read_region, start)))
                if not in_flight:
                    return  # stopped
                start, future = in_flight.popleft()
                end = min(self.size, start + STAGE_REGION_BYTES)
                if start + future.result() < end:
                    raise OSError(errno.EIO, f"the file ended at {start + future.result()} of {self.size} bytes")
                self._passed(end)

    def _release(self) -> None:
        self._whole.release()
        self._memory.close()


def open_for_staging(path: os.PathLike[str] | str, *, direct: bool = True) -> tuple[int, bool]:
    """``path`` opened for reading: (descriptor, whether it is O_DIRECT). O_DIRECT where
    ``direct`` and the filesystem takes it (EINVAL at open otherwise: tmpfs before Linux
    6.6, some FUSE and network filesystems). OSError as ``os.open`` raises it."""
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag | os.O_CLOEXEC), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False


def stage_file(fd: int, size: int, *, direct: bool) -> Staging:
    """The file open on ``fd`` (``size`` bytes; ``direct``: opened O_DIRECT) being staged."""
    return DirectStaging(fd, size) if direct else MappedStaging(fd, size)
