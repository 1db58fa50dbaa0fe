"""Where a rank writer's bytes go, in file order: :class:`DirectSink` (O_DIRECT through aligned
bounce buffers: buffered writes leave the pace to the kernel's writeback, and safetensors packs
tensors without block alignment) or :class:`BufferedSink` (``pwrite`` into the page cache), chosen
by :func:`open_sink`. Call order (the writer)::

    [address = sink.map(size)]                   # a file in memory, mapped: another thread may copy into it
    sink.write_all(header)                       # the file's first bytes
    for each piece of each chunk:                # a piece is at most sink.room() bytes
        with sink.put(piece, stable) as placed:  # placed at the sink's position, not final;
            checksum.update(placed)              # the caller checksums the bytes as placed
        [with sink.replace(other, stable) as placed: ...]  # the same range, from another source
        [or: with sink.put_mapped(n) as placed]  # the piece is in the mapping already
        sink.advance()                           # final: no buffer holding it goes to disk before
    sink.finish()                                # everything written and fsynced
    sink.close()                                 # on every path (a context manager)
"""

from __future__ import annotations

import abc
import collections
import contextlib
import errno
import logging
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from swap_state.common.segment import align_up
from swap_state.server import _posix
from swap_state.server.logs import log_event
from swap_state.server.snapshot.tiers.spares import SpareFiles
from swap_state.server.snapshot.writing.snapshot_file import SnapshotFile, pwrite_all

__all__ = ["BLOCK_BYTES", "BufferedSink", "ChunkSink", "DirectSink", "copy_piece", "open_sink"]

log = logging.getLogger(__name__)

BLOCK_BYTES = 4096  # the alignment O_DIRECT needs on every filesystem Linux has (logical blocks are 512 or 4096)

BOUNCE_BYTES = 8 << 20  # one bounce buffer, one write: reaches the disk's O_DIRECT bandwidth with one or two in flight

WRITES_IN_FLIGHT = 2  # bounce buffers being written at once while the next one fills
_WRITEBACK_BYTES = 8 << 20  # the buffered sink starts the disk writeback of every this many bytes


class ChunkSink(contextlib.AbstractContextManager):
    """The bytes of one data file, in order (the call order: the module docstring)."""

    direct: bool = False  # whether the bytes bypass the page cache (O_DIRECT)
    owns_placed: bool = False  # whether what put returns is a copy of the sink's own, unchanged until advance
    stager_first: bool = True
    """Whether the writer lets the stager copy before each chunk (its copies are what the trainer's next step waits for,
    and this sink's copies and sends compete with them); not an O_DIRECT sink's, whose pause would idle the disk."""

    def __init__(self) -> None:
        self.position = 0  # file offset of the next put
        self._pending = 0  # bytes of the last put, not final yet

    @abc.abstractmethod
    def room(self) -> int:
        """The most bytes the next :meth:`put` takes."""

    @abc.abstractmethod
    def put(self, data: memoryview, stable: bool = False) -> memoryview:
        """Place ``data`` (at most :meth:`room` bytes) at :attr:`position`, not final yet; the
        bytes as placed (what reaches the file), for the caller to checksum and release before
        :meth:`advance`. ``stable``: ``data`` keeps its bytes until :meth:`advance` (a stager's
        or the trainer's slot does; the segment does not: the trainer may write it)."""

    def replace(self, data: memoryview, stable: bool = False) -> memoryview:
        """Place ``data`` over the last :meth:`put` (the same length); as :meth:`put`."""
        if data.nbytes != self._pending:
            raise ValueError("replace takes the length of the last put")
        return self.put(data, stable)

    def map(self, nbytes: int) -> int | None:
        """The file, ``nbytes`` long, mapped for another thread to copy pieces into (the stager of a memory-only
        snapshot), until :meth:`close`: the address of its first byte; None where the sink cannot (not in memory)."""
        return None

    def put_mapped(self, nbytes: int) -> memoryview:
        """As :meth:`put`, of the ``nbytes`` at :attr:`position` that were copied into the :meth:`map` (a stable view)."""
        raise NotImplementedError(f"{type(self).__name__} has no mapping")

    @abc.abstractmethod
    def advance(self) -> None:
        """The last :meth:`put` (or :meth:`replace`) is final."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Every final byte written and durable (fsync)."""

    def close(self) -> None:
        """Release what the sink holds, its file included (idempotent); makes nothing durable."""

    def write_all(self, data: bytes) -> None:
        """``data`` at :attr:`position`, final (the safetensors header)."""
        with memoryview(data) as view:
            for _ in self.put_pieces(view, stable=True):
                pass

    def put_pieces(self, data: memoryview, stable: bool = False) -> Iterator[memoryview]:
        """Put ``data`` piece by piece (each at most :meth:`room`): each is yielded as placed, for
        the caller to checksum (and check), and final (:meth:`advance`) when the next is asked for."""
        done = 0
        while done < data.nbytes:
            with data[done : done + self.room()] as piece, self.put(piece, stable) as placed:
                yield placed
                done += piece.nbytes
            self.advance()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BufferedSink(ChunkSink):
    """``pwrite`` from the caller's view straight into the page cache (no copy of its own),
    writeback started every ``_WRITEBACK_BYTES``; fsync at the end. A file in memory (tmpfs)
    may be a spare file, longer than what is written: the end cuts it to size."""

    def __init__(self, file: SnapshotFile, spares: SpareFiles | None = None):
        super().__init__()
        self.file = file  # owned: closed with the sink
        self._fd = file.fileno()
        self._kicked = 0  # file bytes [0, _kicked) have had writeback started
        self._spares = spares  # where a file in memory is mapped (kept between snapshots)
        # The mapping, held (an export) until closed: the file removed meanwhile (its step discarded), the spares let go
        # of it but cannot unmap it under the stager's copies (mmap.close refuses while exported).
        self._mapped: memoryview | None = None

    def map(self, nbytes: int) -> int | None:
        if self._spares is None:
            return None
        try:
            os.ftruncate(self._fd, nbytes)  # a spare file may be longer
            # Every block now: a full tmpfs fails here (ENOSPC), not with SIGBUS in the stager's copy.
            os.posix_fallocate(self._fd, 0, nbytes)
            mapping = self._spares.mapping(self._fd, nbytes)
        except OSError as exc:  # tmpfs full, no /proc, the memory map's limit: pwrite, which fails the snapshot cleanly
            log_event(log, "snapshot_file_unmapped", logging.WARNING, path=str(self.file.path), error=str(exc))
            return None
        self._mapped = memoryview(mapping)
        return _posix.buffer_address(mapping)

    def put_mapped(self, nbytes: int) -> memoryview:
        if self._mapped is None:
            raise ValueError("put_mapped before map")
        self._pending = nbytes
        return self._mapped[self.position : self.position + nbytes]

    def room(self) -> int:
        return 1 << 62

    def put(self, data: memoryview, stable: bool = False) -> memoryview:
        pwrite_all(self._fd, data, self.position)
        self._pending = data.nbytes
        return data[:]  # the caller's bytes as written; the caller's own view stays its own

    def advance(self) -> None:
        self.position += self._pending
        self._pending = 0
        if self.position - self._kicked >= _WRITEBACK_BYTES:
            # sync_file_range: the kernel starts writing these pages now, so the fsync at the end
            # finds little left and the dirty pages of a big snapshot do not pile up.
            _posix.start_writeback(self._fd, self._kicked, self.position - self._kicked)
            self._kicked = self.position

    def finish(self) -> None:
        os.ftruncate(self._fd, self.position)
        self.file.fsync()

    def close(self) -> None:
        mapped, self._mapped = self._mapped, None  # the mapping stays the spares' (kept for the file's next writer)
        if mapped is not None:
            mapped.release()
        self.file.close()


class DirectSink(ChunkSink):
    """O_DIRECT writes of ``WRITES_IN_FLIGHT + 1`` aligned bounce buffers: one fills while a pool
    writes the others. The last is written padded to a block, the file truncated back before
    the fsync. A write refused with EINVAL after the open is made buffered instead, logged once."""

    direct, stager_first, owns_placed = True, False, True

    def __init__(self, file: SnapshotFile, direct_fd: int, bounce_bytes: int | None = None):
        super().__init__()
        self.file = file  # owned: closed with the sink
        bounce_bytes = BOUNCE_BYTES if bounce_bytes is None else bounce_bytes
        if bounce_bytes <= 0 or bounce_bytes % BLOCK_BYTES:
            raise ValueError(f"bounce_bytes must be a positive multiple of {BLOCK_BYTES}")
        self._direct_fd: int | None = direct_fd
        self._bounce = bounce_bytes
        self._free = collections.deque(mmap.mmap(-1, bounce_bytes) for _ in range(WRITES_IN_FLIGHT + 1))
        self._busy: collections.deque[tuple[mmap.mmap, Future[None]]] = collections.deque()
        self._pool = ThreadPoolExecutor(max_workers=WRITES_IN_FLIGHT, thread_name_prefix="snapshot-write")
        self._current = self._free.popleft()
        self._address = _posix.buffer_address(self._current)
        self._fill = 0  # final bytes in the current buffer
        self.fell_back = False

    def room(self) -> int:
        return self._bounce - self._fill

    def put(self, data: memoryview, stable: bool = False) -> memoryview:
        n = data.nbytes
        if n > self.room():
            raise ValueError(f"a piece of {n} bytes does not fit the {self.room()} left")
        copy_piece(self._current, self._address, self._fill, data)
        self._pending = n
        with memoryview(self._current) as whole:
            return whole[self._fill : self._fill + n]

    def advance(self) -> None:
        self._fill += self._pending
        self.position += self._pending
        self._pending = 0
        if self._fill == self._bounce:
            self._submit(self._bounce)

    def _submit(self, nbytes: int) -> None:
        """Write the current buffer's first ``nbytes`` (a block multiple) in the pool and take the
        next free buffer (waiting for the oldest write when none is free)."""
        buffer, offset = self._current, self.position - self._fill
        self._busy.append((buffer, self._pool.submit(self._write, buffer, nbytes, offset)))
        if not self._free:
            self._retire()
        self._current = self._free.popleft()
        self._address = _posix.buffer_address(self._current)
        self._fill = 0

    def _retire(self) -> None:
        """Wait for the oldest write in flight; its buffer is free again."""
        buffer, future = self._busy.popleft()
        future.result()
        self._free.append(buffer)

    def _write(self, buffer: mmap.mmap, nbytes: int, offset: int) -> None:
        with memoryview(buffer) as whole, whole[:nbytes] as data:
            fd = self._direct_fd
            if fd is not None:
                try:
                    pwrite_all(fd, data, offset)
                    return
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    if not self.fell_back:
                        self.fell_back = True
                        log_event(log, "snapshot_direct_io_refused", logging.WARNING, error=str(exc),
                                  detail="the filesystem accepted O_DIRECT at open but refused a write: "
                                  "this snapshot's writes go through the page cache")
            pwrite_all(self.file.fileno(), data, offset)

    def finish(self) -> None:
        if self._fill:
            padded = align_up(self._fill, BLOCK_BYTES)
            self._current[self._fill : padded] = bytes(padded - self._fill)
            self._submit(padded)
        while self._busy:
            self._retire()
        os.ftruncate(self.file.fileno(), self.position)  # the last block was written padded
        self.file.fsync()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.shutdown(wait=True)  # no write may land in a buffer being unmapped
        self.file.close()
        fd, self._direct_fd = self._direct_fd, None
        if fd is not None:
            os.close(fd)
        for buffer in [self._current, *self._free, *(b for b, _ in self._busy)]:
            buffer.close()
        self._busy.clear()
        self._free.clear()


def copy_piece(buffer: mmap.mmap | bytearray, address: int, offset: int, data: memoryview) -> None:
    """``data`` into ``buffer`` (whose first byte is at ``address``) at ``offset``."""
    if data.readonly:  # the header, from bytes: small, copied holding the GIL
        buffer[offset : offset + data.nbytes] = data
    else:  # a segment's bytes: copied with the GIL released
        _posix.memmove(address + offset, _posix.buffer_address(data), data.nbytes)


def open_sink(file: SnapshotFile, spares: SpareFiles | None = None) -> ChunkSink:
    """A :class:`DirectSink` when ``file`` gives an O_DIRECT descriptor, else a :class:`BufferedSink` (which maps
    ``file`` where given the ``spares`` of its directory in memory); the sink owns ``file`` (closed with it, here when
    no sink could be made)."""
    try:
        fd = file.open_direct()
        return BufferedSink(file, spares) if fd is None else DirectSink(file, fd)
    except BaseException:
        file.close()
        raise
