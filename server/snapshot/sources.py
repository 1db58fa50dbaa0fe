"""A local rank file a restore's plan takes whole (:func:`copy_whole_file`) is read once
(*staged*, :class:`Staging`: mapped, read ahead and pinned with ``mlock`` by a reader thread)
while this thread checksums it; only when every checksum passed are the bytes copied into the
segment. Where ``mlock`` is refused the pages may be evicted, so every copied chunk is checked
again as it lands: a file that changed underneath fails the restore ("restore again"). Mapped,
not O_DIRECT into fresh memory: that was slower on the 2-core VM, where fresh memory faults in
at about the disk's rate (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading

from swap_state.common.checksum import crc32
from swap_state.common.segment import SegmentLayout
from swap_state.common.snapshot_errors import SnapshotCorrupt, SnapshotError
from swap_state.common.snapshot_format import RankManifest
from swap_state.common.snapshot_reader import RankFileVerifier, SnapshotInfo, reading_file
from swap_state.server import _posix
from swap_state.server.logs import log_event

__all__ = ["copy_whole_file"]

log = logging.getLogger("swap_state.server.restore")

_COPY_BYTES = 8 << 20
"""Unit of the copy into the segment (and of its re-check when the pages are not pinned)."""
STAGE_REGION_BYTES = 16 << 20
"""The reader thread reads (and pins) the file in regions of this size."""
READ_AHEAD_REGIONS = 8
"""Regions the reader asks the kernel to read ahead of the one it pins."""

_mlock = _posix.mlock  # a module name, so that tests can replace it


def copy_whole_file(info: SnapshotInfo, manifest: RankManifest, view: memoryview, layout: SegmentLayout) -> bool:
    """Stage the rank's data file of a snapshot in a directory once, verify all of it, then
    copy its tensors to their places in ``view`` (``layout``'s, in the same order); whether the
    staged bytes were pinned (else each copy was checked again)."""
    verifier = RankFileVerifier(info, manifest)  # the reader's checks, fed from the staged pages
    path = verifier.path
    with reading_file(path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            verifier.check_size(size)
            try:
                staged = Staging(fd, size)
            except OSError as exc:
                raise SnapshotError(f"cannot map {path}: {exc}") from None
            try:
                header_end = len(verifier.header)  # each region checksummed once the reader has it
                staged.wait(header_end)
                verifier.check_header(staged.view[:header_end])
                position, region = header_end, STAGE_REGION_BYTES
                while position < size:
                    upto = min(size, (position // region + 1) * region)
                    staged.wait(upto)
                    verifier.feed(staged.view[position:upto])
                    position = upto
                verifier.finish()
                if not staged.pinned:
                    log_event(log, "restore_unpinned", logging.WARNING, path=path, bytes=size,
                              errno=staged.pin_errno,
                              detail="mlock refused (RLIMIT_MEMLOCK?): the staged pages may be evicted; "
                              "every copied chunk is checked again")
                _copy_staged(staged, manifest, view, layout, path)  # verified: only now the segment changes
                return staged.pinned
            finally:
                staged.close()
        finally:
            os.close(fd)


def _copy_staged(staged: Staging, manifest: RankManifest, view: memoryview, layout: SegmentLayout,
                 path: os.PathLike[str]) -> None:
    """Every (verified) tensor from the staged mapping into its place in the segment; the
    copies re-checked when the pages were not pinned."""
    base = _posix.buffer_address(view)
    for tensor, target in zip(manifest.tensors, layout.tensors):
        source = manifest.data_start + tensor.data_offsets[0]
        value = 0
        for done in range(0, target.nbytes, _COPY_BYTES):
            n = min(_COPY_BYTES, target.nbytes - done)
            _posix.memmove(base + target.offset + done, staged.address + source + done, n)
            if not staged.pinned:
                with view[target.offset + done : target.offset + done + n] as landed:
                    value = crc32(landed, value)
        if not staged.pinned and value != tensor.crc32:
            raise SnapshotCorrupt(f"{path} changed while being restored (tensor {tensor.name!r} no longer "
                                  "matches its checksum); the segment is partially overwritten: restore "
                                  "again")


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
