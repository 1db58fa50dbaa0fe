"""Restore's reads: every source tensor a plan needs, streamed in file order and checked against
its crc32 as its bytes pass (:func:`stream_tensors`); the caller decides where the bytes go. Local
files are read by a reader thread with O_DIRECT, one read in flight, into a ring of buffers reused
from restore to restore (a read into freshly touched memory is slower: docs/benchmarks.md); any
other tier (an object store) tensor by tensor into memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import pathlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from swap_state.common.checksum import crc32
from swap_state.common.segment import align_up
from swap_state.common.snapshot_errors import SnapshotCorruptError, SnapshotError
from swap_state.common.snapshot_format import RankManifest, TensorRecord
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier, reading_file
from swap_state.server import _posix

__all__ = ["BLOCK_BYTES", "Deliver", "read_spans", "stream_tensors"]

BLOCK_BYTES = 8 << 20
"""One read: the size at which the VM's disk reached its O_DIRECT rate (as the writer's)."""
RING_BUFFERS = 2
"""Blocks in the ring: one being read while the one before is checked and delivered."""
_ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and addresses on every Linux filesystem
_MERGE_GAP = 1 << 20  # tensors of one file this close are read as one span (the gap read and dropped)

Wanted = Mapping[int, tuple[RankManifest, Sequence[TensorRecord]]]
"""Per source rank: its manifest and the tensors read from its data file."""

Deliver = Callable[[tuple[int, str], int, int, int], None]
"""``deliver(key, offset, address, nbytes)``: bytes ``[offset, offset + nbytes)`` of the source
tensor ``key`` (source rank, name) are at ``address``, valid during the call only. A tensor's
bytes come in order; they are not yet verified (its checksum is checked after its last byte)."""


def stream_tensors(tier: SnapshotTier, info: SnapshotInfo, wanted: Wanted, deliver: Deliver) -> None:
    """Read every tensor of ``wanted`` once (each data file's header checked first), delivering its
    bytes in order as read. SnapshotCorruptError names the file and tensor whose checksum fails; its
    bytes and those before were delivered: the caller undoes them."""
    for rank, (manifest, tensors) in wanted.items():
        tier.check_data_header(info, manifest)
        path = tier.local_file(info, manifest.data_file)
        if path is None:
            for tensor in tensors:  # read whole and checked by the tier, then delivered
                if tensor.nbytes:
                    data = tier.read_tensor(info, manifest, tensor)
                    held = data if type(data) is bytes else bytes(data)  # alive through the delivery
                    deliver((rank, tensor.name), 0, _posix.bytes_address(held), tensor.nbytes)
            continue
        with _FileStream(path, manifest, tensors) as stream:
            stream.run(lambda name, *where: deliver((rank, name), *where))


@dataclasses.dataclass
class _Span:
    """Tensors of one file read as one aligned range ``[start, end)`` of the file."""

    start: int
    end: int
    tensors: list[TensorRecord]


def read_spans(manifest: RankManifest, tensors: Sequence[TensorRecord]) -> list[_Span]:
    """The ranges of ``manifest``'s data file a restore reads for ``tensors``."""
    data_start = manifest.data_start
    spans: list[_Span] = []
    for tensor in sorted((t for t in tensors if t.nbytes), key=lambda t: t.data_offsets[0]):
        begin, end = data_start + tensor.data_offsets[0], data_start + tensor.data_offsets[1]
        if spans and begin - spans[-1].end <= _MERGE_GAP:
            spans[-1].end = max(spans[-1].end, align_up(end, _ALIGN))
            spans[-1].tensors.append(tensor)
        else:
            spans.append(_Span(begin - begin % _ALIGN, align_up(end, _ALIGN), [tensor]))
    return spans


class _Ring:
    """``RING_BUFFERS`` page-aligned buffers of ``BLOCK_BYTES``; rings are kept for the next
    restore (their pages stay touched), one per restore running at once."""

    _free: list[_Ring] = []
    _lock = threading.Lock()

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.memory = mmap.mmap(-1, RING_BUFFERS * block_bytes)
        self.view = memoryview(self.memory)
        self.address = _posix.buffer_address(self.view)

    def buffer(self, index: int) -> memoryview:
        return self.view[index * self.block_bytes:(index + 1) * self.block_bytes]

    @classmethod
    @contextlib.contextmanager
    def taken(cls) -> Iterator[_Ring]:
        with cls._lock:
            ring = cls._free.pop() if cls._free else None
        if ring is None or ring.block_bytes != BLOCK_BYTES:
            ring = _Ring(BLOCK_BYTES)
        try:
            yield ring
        finally:
            with cls._lock:
                cls._free.append(ring)


class _FileStream:
    """One rank's data file read span by span, block by block, by a reader thread (one read in
    flight) into a ring, while :meth:`run` checks and delivers each block."""

    def __init__(self, path: pathlib.Path, manifest: RankManifest, tensors: Sequence[TensorRecord]):
        self.path = path
        self._spans = read_spans(manifest, tensors)
        with reading_file(path):
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # a filesystem without O_DIRECT (tmpfs): buffered
                    raise
                self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self.direct = False
        self._data_start = manifest.data_start
        try:
            self.size = os.fstat(self._fd).st_size
            if self.size != manifest.data_file_bytes:
                raise SnapshotCorruptError(f"{path} changed while being restored: restore again")
        except BaseException:
            os.close(self._fd)
            raise
        self._stack = contextlib.ExitStack()
        self._free: queue.Queue[int] = queue.Queue()
        self._full: queue.Queue[tuple[int, int, int] | BaseException | None] = queue.Queue()
        self._stop = threading.Event()

    def __enter__(self) -> _FileStream:
        self._ring = self._stack.enter_context(_Ring.taken())
        for index in range(RING_BUFFERS):
            self._free.put(index)
        self._thread = threading.Thread(target=self._read_all, name="restore-read", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for index in range(RING_BUFFERS):  # a reader waiting for a buffer wakes and sees the stop
            self._free.put(index)
        self._thread.join()
        os.close(self._fd)
        self._stack.close()

    def _read_all(self) -> None:
        try:
            block = self._ring.block_bytes
            for span in self._spans:
                for position in range(span.start, span.end, block):
                    index = self._free.get()
                    if self._stop.is_set():
                        return
                    length = min(block, span.end - position)
                    self._full.put((index, position, self._read(self._ring.buffer(index)[:length], position)))
        except BaseException as exc:  # raised by run()
            self._full.put(exc)

    def _read(self, buffer: memoryview, position: int) -> int:
        """Read ``buffer`` whole from ``position``, unless the file ends first; bytes read."""
        done = 0
        while done < len(buffer):
            got = self._read_once(buffer[done:], position + done)
            if got == 0:
                break
            done += got
        return done

    def _read_once(self, buffer: memoryview, position: int) -> int:
        try:
            return os.preadv(self._fd, [buffer], position)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise SnapshotError(f"cannot read {self.path}: {exc}") from None
            # Opened, then refused (a filesystem that takes the flag but not the I/O): buffered.
            os.close(self._fd)
            self._fd, self.direct = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), False
            return os.preadv(self._fd, [buffer], position)

    def run(self, deliver: Callable[[str, int, int, int], None]) -> None:
        """Check and deliver every block as the reader hands it over (SnapshotCorruptError on a
        tensor whose crc32 fails, after its last bytes were delivered)."""
        for span in self._spans:
            pending = list(span.tensors)  # in file order; the first one is being read
            value = 0
            while pending:
                item = self._full.get()
                if isinstance(item, BaseException):
                    raise item
                index, at, got = item
                if got < min(self._ring.block_bytes, span.end - at) and at + got < self.size:  # short before the end
                    raise SnapshotError(f"{self.path}: a read at {at} returned {got} bytes, short of the file's end")
                address = self._ring.address + index * self._ring.block_bytes
                while pending:
                    tensor = pending[0]
                    start = self._data_start + tensor.data_offsets[0]
                    if start >= at + got:
                        break  # it starts in a later block (this one was a gap between tensors)
                    lo, hi = max(start, at), min(start + tensor.nbytes, at + got)
                    with _posix.view_at(address + lo - at, hi - lo) as part:
                        value = crc32(part, value)
                    deliver(tensor.name, lo - start, address + lo - at, hi - lo)
                    if hi < start + tensor.nbytes:
                        break  # its next bytes are in the next block
                    if value != tensor.crc32:
                        raise SnapshotCorruptError(f"{self.path}: tensor {tensor.name!r} fails its checksum "
                                              f"(crc32 {value:08x}, manifest says {tensor.crc32:08x})")
                    pending.pop(0)
                    value = 0
                self._free.put(index)
