"""Restore's reads: the byte ranges of source tensors a plan needs (:class:`TensorRead`, rounded out to the tensors'
checksum blocks), streamed in file order, each block checked against its crc32 as its bytes pass
(:func:`stream_tensors`); the caller decides where the bytes go. Ranges that meet in a file are read as one span,
nothing between them. A local file is read with O_DIRECT (spans aligned to its 4 KiB), any other tier (an object store,
a peer) by exact byte range; either by a reader thread, one read in flight, into a ring of buffers reused from restore
to restore (a read into freshly touched memory is slower: docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import pathlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from swap_state.common.checksum import crc32
from swap_state.common.segment import align_up
from swap_state.common.snapshot_errors import SnapshotCorruptError, SnapshotError
from swap_state.common.snapshot_format import RankManifest, TensorRecord
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier, reading_file
from swap_state.server import _posix
from swap_state.server.snapshot.restoring.reshard import Piece
from swap_state.server.snapshot.tiers.spares import hold_for_reading

__all__ = ["BLOCK_BYTES", "Deliver", "TensorRead", "pieces_by_source", "plan_reads", "read_spans", "stream_tensors"]

BLOCK_BYTES = 8 << 20
"""One read: the size at which the VM's disk reached its O_DIRECT rate (as the writer's)."""
RING_BUFFERS = 2
"""Blocks in the ring: one being read while the one before is checked and delivered."""
_ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and addresses on every Linux filesystem


@dataclasses.dataclass(frozen=True)
class TensorRead:
    """What a restore reads of one source tensor: byte ranges ``[lo, hi)`` of its bytes, each
    made of whole checksum blocks (so each is checked), ascending and disjoint."""

    tensor: TensorRecord
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def covering(cls, tensor: TensorRecord, runs: Iterable[tuple[int, int]]) -> TensorRead:
        """The ranges holding every ``[start, end)`` of ``runs``, rounded out to the tensor's blocks."""
        block, merged = tensor.block_size, []
        for start, end in sorted(runs):
            lo, hi = start - start % block, min(align_up(end, block), tensor.nbytes)
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            elif hi > lo:
                merged.append((lo, hi))
        return cls(tensor, tuple(merged))


Wanted = Mapping[int, tuple[RankManifest, Sequence[TensorRead]]]
"""Per source rank: its manifest and what is read from its data file."""

def pieces_by_source(plan: Mapping[str, Sequence[Piece]]) -> dict[tuple[int, str], list[tuple[str, Piece]]]:
    """``plan``'s pieces by source tensor (old rank, name), each with the target it fills."""
    by_source: dict[tuple[int, str], list[tuple[str, Piece]]] = {}
    for name, piece in ((name, piece) for name, pieces in plan.items() for piece in pieces):
        by_source.setdefault((piece.source_rank, piece.source.name), []).append((name, piece))
    return by_source


def plan_reads(plan: Mapping[str, Sequence[Piece]], manifests: Mapping[int, RankManifest]) -> Wanted:
    """What a restore reads for ``plan``: per source tensor the bytes its pieces' runs need."""
    wanted: dict[int, tuple[RankManifest, list[TensorRead]]] = {}  # by old rank, its tensors in name order
    for (rank, _), items in sorted(pieces_by_source(plan).items()):
        runs = [(run.source_offset, run.source_offset + run.nbytes) for _, piece in items for run in piece.runs]
        wanted.setdefault(rank, (manifests[rank], []))[1].append(TensorRead.covering(items[0][1].source, runs))
    return wanted


Deliver = Callable[[tuple[int, str], int, int, int], None]
"""``deliver(key, offset, address, nbytes)``: bytes ``[offset, offset + nbytes)`` of the source tensor ``key`` (source
rank, name) are at ``address``, valid during the call only. A tensor's bytes come in ascending order; they are not yet
verified (a block's checksum is checked after its last byte)."""


def stream_tensors(tier: SnapshotTier, info: SnapshotInfo, wanted: Wanted, deliver: Deliver) -> None:
    """Read every range of ``wanted`` once (each data file's header checked first), delivering its
    bytes in order as read. SnapshotCorruptError names the file and tensor whose checksum fails; its
    bytes and those before were delivered: the caller undoes them."""
    for rank, (manifest, reads) in wanted.items():
        tier.check_data_header(info, manifest)
        path = tier.local_file(info, manifest.data_file)
        opened = contextlib.nullcontext(_TierFile(tier, info, manifest)) if path is None else _LocalFile(path, manifest)
        with opened as source, _Stream(source, manifest, read_spans(manifest, reads, source.align)) as stream:
            stream.run(lambda name, *where: deliver((rank, name), *where))


@dataclasses.dataclass
class _Span:
    """Ranges of one file read as one range ``[start, end)`` of the file."""

    start: int
    end: int
    items: list[tuple[TensorRecord, int, int]]  # (tensor, lo, hi), in file order


def read_spans(manifest: RankManifest, reads: Sequence[TensorRead], align: int = _ALIGN) -> list[_Span]:
    """The ranges of ``manifest``'s data file a restore reads for ``reads``, ``align``-aligned."""
    items = sorted(((read.tensor, lo, hi) for read in reads for lo, hi in read.ranges),
                   key=lambda item: item[0].data_offsets[0] + item[1])
    spans: list[_Span] = []
    for tensor, lo, hi in items:
        begin, end = (manifest.data_start + tensor.data_offsets[0] + at for at in (lo, hi))
        if spans and begin - begin % align <= spans[-1].end:
            spans[-1].end = max(spans[-1].end, align_up(end, align))
            spans[-1].items.append((tensor, lo, hi))
        else:
            spans.append(_Span(begin - begin % align, align_up(end, align), [(tensor, lo, hi)]))
    return spans


class _BlockCheck:
    """One range of a tensor checked block by block as its bytes come (its start: a block's)."""

    def __init__(self, tensor: TensorRecord, lo: int, path: pathlib.Path):
        self.tensor, self.path = tensor, path
        self.index, self.value, self.fill = lo // tensor.block_size, 0, 0

    def feed(self, data: memoryview) -> None:
        tensor, at = self.tensor, 0
        while at < data.nbytes:
            block = min(tensor.block_size, tensor.nbytes - self.index * tensor.block_size)
            take = min(data.nbytes - at, block - self.fill)
            with data[at : at + take] as part:
                self.value = crc32(part, self.value)
            at, self.fill = at + take, self.fill + take
            if self.fill == block:
                expected = tensor.block_crc(self.index)
                if self.value != expected:
                    where = f"block {self.index}: " if tensor.block_bytes else ""
                    raise SnapshotCorruptError(f"{self.path}: tensor {tensor.name!r} fails its checksum ({where}crc32 "
                                               f"{self.value:08x}, manifest says {expected:08x})")
                self.index, self.value, self.fill = self.index + 1, 0, 0


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


class _TierFile:
    """A file of a tier without one on this host's filesystem, by exact byte ranges. A source of bytes for
    :class:`_Stream`, as :class:`_LocalFile`: :meth:`read` fills ``buffer`` (at ``address``) from ``position`` unless
    the file ends first, or points into memory holding them: (where they are, how many); reads are ``align``-aligned."""

    align = 1

    def __init__(self, tier: SnapshotTier, info: SnapshotInfo, manifest: RankManifest):
        self._tier, self._info, self._name, self.path = tier, info, manifest.data_file, info.path / manifest.data_file

    def read(self, buffer: memoryview, address: int, position: int) -> tuple[int, int]:
        data = self._tier.read_range(self._info, self._name, position, buffer.nbytes)
        if len(data) > buffer.nbytes:  # a store or peer answering with more than asked: not trusted
            raise SnapshotCorruptError(f"{self.path}: a read of {buffer.nbytes} bytes at {position} returned {len(data)}")
        buffer[: len(data)] = data
        return address, len(data)


class _LocalFile:
    """A file on this host, read with O_DIRECT where its filesystem takes it, else buffered; a file in memory (tmpfs:
    this host's memory-only snapshots, the replicas it holds) is mapped and read where it lies, without a copy, held for
    reading so that no step written later reuses it."""

    align = _ALIGN

    def __init__(self, path: pathlib.Path, manifest: RankManifest):
        self.path = path
        with reading_file(path):
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # a filesystem without O_DIRECT (tmpfs): buffered
                    raise
                self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self.direct = False
        self._mapped: mmap.mmap | None = None
        try:
            in_memory = _posix.in_memory(self._fd)
            if in_memory:
                hold_for_reading(self._fd, path)
            if os.fstat(self._fd).st_size != manifest.data_file_bytes:
                raise SnapshotCorruptError(f"{path} changed while being restored: restore again")
            if in_memory:  # private: never written, so never copied
                self._mapped = mmap.mmap(self._fd, 0, flags=mmap.MAP_PRIVATE)
                self._mapped_at = _posix.buffer_address(self._mapped)
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> _LocalFile:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._mapped is not None:
            self._mapped.close()
        os.close(self._fd)

    def read(self, buffer: memoryview, address: int, position: int) -> tuple[int, int]:
        if self._mapped is not None:
            return self._mapped_at + position, max(0, min(len(buffer), len(self._mapped) - position))
        done = 0
        while done < len(buffer):
            got = self._read_once(buffer[done:], position + done)
            if got == 0:
                break
            done += got
        return address, done

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


class _Stream:
    """One data file's spans read block by block by a reader thread (one read in flight) into
    a ring, which also checks each block's crc32s, while :meth:`run`, in the caller's thread,
    delivers the blocks read before: the copies and the checks run on two cores."""

    def __init__(self, source: _LocalFile | _TierFile, manifest: RankManifest, spans: list[_Span]):
        self._source, self._spans = source, spans
        self._data_start, self._size = manifest.data_start, manifest.data_file_bytes
        self._stack = contextlib.ExitStack()
        self._free: queue.Queue[int] = queue.Queue()
        self._full: queue.Queue[tuple[int, list[tuple]] | BaseException | None] = queue.Queue()
        self._stop = threading.Event()

    def __enter__(self) -> _Stream:
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
        self._stack.close()

    def _read_all(self) -> None:
        try:
            for span in self._spans:
                if self._stop.is_set():  # run() gave up: nobody takes the blocks
                    return
                self._read_span(span)
            self._full.put(None)
        except BaseException as exc:  # raised by run(), after the deliveries before it
            self._full.put(exc)

    def _read_span(self, span: _Span) -> None:
        """Each block of ``span`` read and its tensors' blocks checked; handed to :meth:`run` as
        the deliveries it makes. SnapshotCorruptError after the deliveries before the failure."""
        pending, check, block = list(span.items), None, self._ring.block_bytes  # items in file order
        for at in range(span.start, span.end, block):
            index = self._free.get()
            if self._stop.is_set():
                return
            length = min(block, span.end - at)
            address, got = self._source.read(self._ring.buffer(index)[:length], self._ring.address + index * block, at)
            if got < length and at + got < self._size:
                raise SnapshotError(f"{self._source.path}: a read at {at} returned {got} bytes, short of the file's end")
            deliveries: list[tuple[str, int, int, int]] = []
            try:
                while pending:
                    tensor, lo, hi = pending[0]
                    start = self._data_start + tensor.data_offsets[0]
                    if start + lo >= at + got:
                        break  # it starts in a later block
                    check = check or _BlockCheck(tensor, lo, self._source.path)
                    first, last = max(start + lo, at), min(start + hi, at + got)
                    with _posix.view_at(address + first - at, last - first) as part:
                        check.feed(part)
                    deliveries.append((tensor.name, first - start, address + first - at, last - first))
                    if last < start + hi:
                        break  # its next bytes are in the next block
                    pending.pop(0)
                    check = None
            finally:
                self._full.put((index, deliveries))

    def run(self, deliver: Callable[[str, int, int, int], None]) -> None:
        """Deliver every block as the reader hands it over, checked (SnapshotCorruptError on a
        block whose crc32 fails, after the bytes before it were delivered)."""
        while (item := self._full.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            index, deliveries = item
            for delivery in deliveries:
                deliver(*delivery)
            self._free.put(index)
