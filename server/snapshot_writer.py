"""The server's side of the copy-before-write protocol: persist one rank's segment.

Call order (the coordinator does this, :mod:`swap_state.server.snapshot`):

1. ``RankWriter(...)`` then, synchronously in the Snapshot call, :meth:`RankWriter.publish`:
   frees leftover copy slots, stores ``SNAP_STEP``, ``PERSISTED_UPTO = 0`` and last
   ``SNAP_EPOCH = e``. From its return the snapshot is *consistent*.
2. :meth:`RankWriter.run` in a background thread: streams the chunks in update order into
   ``rank-XXXXX.safetensors`` in the partial directory, storing ``PERSISTED_UPTO = c + 1``
   as soon as chunk c is *read* (before its disk write, so the trainer is held up by memory
   speed and the bandwidth cap, not by the disk); then releases the segment (``SNAP_EPOCH =
   0``), fsyncs the file and writes the rank manifest. On any error or cancellation the
   segment is released all the same (it is only ever read, never written, apart from the
   server's header words), and the error propagates.

Bytes never leave through anything but this file; the segment's tensor area is read-only here.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
import time
from typing import Any

from swap_state.proto.segment import SegmentHeader, SegmentLayout, Word, chunk_table

from .checksum import crc32, crc32_combine
from .snapshot_errors import SnapshotError, from_os_error
from .snapshot_format import (
    FileRecord,
    RankManifest,
    TensorRecord,
    dumps_json,
    rank_data_name,
    rank_manifest_name,
    safetensors_header,
    safetensors_metadata,
)
from .snapshot_metadata import SnapshotMetadata, TensorMetadata
from .snapshot_store import write_durable

__all__ = ["BandwidthLimiter", "Cancelled", "RankResult", "RankWriter", "SnapshotSource"]


class Cancelled(Exception):
    """The snapshot was cancelled (another rank failed, timeout, shutdown) while persisting."""


class BandwidthLimiter:
    """A shared cap on snapshot read/write throughput in bytes/s (None: no cap).

    Every writer thread reserves its next chunk's bytes on one virtual timeline, so the cap
    holds for the whole server, not per rank. Thread-safe.
    """

    def __init__(self, bytes_per_second: float | None):
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be > 0 (or None for no cap)")
        self.bytes_per_second = bytes_per_second
        self._lock = threading.Lock()
        self._next_free = 0.0  # monotonic time at which the timeline is free again

    def acquire(self, nbytes: int, cancel: threading.Event) -> bool:
        """Block until ``nbytes`` may move; False when ``cancel`` was set meanwhile."""
        if self.bytes_per_second is None:
            return not cancel.is_set()
        with self._lock:
            now = time.monotonic()
            start = max(self._next_free, now)
            self._next_free = start + nbytes / self.bytes_per_second
        if start > now:
            return not cancel.wait(start - now)
        return not cancel.is_set()


@dataclasses.dataclass(frozen=True)
class SnapshotSource:
    """One rank's segment to snapshot, as the servicer hands it to the coordinator."""

    buffer: Any
    """Writable buffer over the whole mapped segment (an mmap or a memoryview of it)."""
    layout: SegmentLayout
    """The segment's layout (``segment.plan_segment``); tensors in update order."""
    header: SegmentHeader
    """A SegmentHeader over the same buffer; owned (and released) by the caller."""
    job_id: str
    """The session's job id; becomes a directory name under the snapshot dir."""
    rank: int
    """The session's rank."""
    world_size: int
    """Ranks of the job; the snapshot is complete when this many ranks are durable."""
    step: int
    """The committed step the segment holds (the caller checks it is the last committed)."""
    metadata_json: str = ""
    """The trainer's description of the tensors (``snapshot_metadata`` schema); may be empty."""


@dataclasses.dataclass(frozen=True)
class RankResult:
    """A rank whose data file and manifest are written and fsynced."""

    manifest: RankManifest
    """The manifest as written."""
    files: tuple[FileRecord, FileRecord]
    """(data file, manifest file) with sizes and crc32s, for snapshot.json."""


class RankWriter:
    """Persists one rank's segment; one instance per rank and snapshot."""

    def __init__(
        self,
        source: SnapshotSource,
        metadata: SnapshotMetadata,
        epoch: int,
        partial_dir: pathlib.Path,
        limiter: BandwidthLimiter,
        cancel: threading.Event,
        snapshot_root: pathlib.Path,
        started_monotonic: float,
    ):
        self.source = source
        self.metadata = metadata
        self.epoch = epoch
        self.partial_dir = partial_dir
        self.limiter = limiter
        self.cancel = cancel
        self.snapshot_root = snapshot_root
        self.started_monotonic = started_monotonic
        layout = source.layout
        self.chunks = chunk_table(layout.tensors, layout.chunk_bytes)
        self.bytes_total = sum(t.nbytes for t in layout.tensors)
        self.bytes_persisted = 0  # written by the writer thread only
        self.segment_released = threading.Event()
        header = source.header
        self._base = (header[Word.COW_COPIES], header[Word.BP_WAITS], header[Word.BP_WAIT_NS])
        self._final: tuple[int, int, int] | None = None

    # --------------------------------------------------------------------- trainer counters

    def counters(self) -> tuple[int, int, int]:
        """(cow copies, back-pressure waits, wait ns) of this snapshot: live while the
        segment is held, frozen from its release on (the segment may be gone after that)."""
        final = self._final
        if final is not None:
            return final
        header = self.source.header
        now = (header[Word.COW_COPIES], header[Word.BP_WAITS], header[Word.BP_WAIT_NS])
        return (now[0] - self._base[0], now[1] - self._base[1], now[2] - self._base[2])

    # --------------------------------------------------------------------- protocol

    def _free_all_slots(self) -> None:
        # A trainer that checked PERSISTED_UPTO <= c just before the server stored c + 1
        # takes a slot whose COW_EPOCH the server never sees, so never frees: reclaim such
        # slots whenever no trainer can be taking one for a live epoch, i.e. before SNAP_EPOCH
        # is published and after it is cleared (a late taker then holds an epoch no reader
        # trusts any more).
        header = self.source.header
        for slot in range(self.source.layout.cow_slots):
            header.set_slot_freed(slot, header.slot_taken(slot))

    def publish(self) -> None:
        """Make the snapshot consistent: after this the trainer may mutate the segment."""
        header = self.source.header
        self._free_all_slots()
        header[Word.SNAP_STEP] = self.source.step
        header[Word.PERSISTED_UPTO] = 0
        header[Word.SNAP_EPOCH] = self.epoch  # last: the trainer keys everything on it

    def release_segment(self) -> None:
        """Clear the epoch (the trainer stops copying), free every slot, freeze the counters.
        Idempotent; ``run`` calls it on every path, the coordinator only if ``run`` never ran."""
        if self.segment_released.is_set():
            return
        header = self.source.header
        header[Word.SNAP_EPOCH] = 0
        self._free_all_slots()
        self._final = self.counters()
        self.segment_released.set()

    # --------------------------------------------------------------------- persisting

    def _stream(self, fd: int, view: memoryview) -> list[int]:
        """Copy every chunk (or its slot) to ``fd``; per-tensor crc32s."""
        layout = self.source.layout
        header = self.source.header
        staging = memoryview(bytearray(layout.chunk_bytes))
        crcs = [0] * len(layout.tensors)
        for chunk in self.chunks:
            if not self.limiter.acquire(chunk.nbytes, self.cancel):
                raise Cancelled()
            n = chunk.nbytes
            staging[:n] = view[chunk.offset : chunk.offset + n]
            # After the read: a trainer that overwrote the chunk meanwhile published a slot
            # with step N's bytes before writing (COW_EPOCH last), so the slot is the truth.
            if header.cow_epoch(chunk.index) == self.epoch:
                slot = header.cow_slot(chunk.index) - 1
                if not 0 <= slot < layout.cow_slots:
                    raise SnapshotError(
                        f"trainer published copy slot {slot} for chunk {chunk.index}; "
                        f"the segment has {layout.cow_slots}"
                    )
                start = layout.cow_slots_offset + slot * layout.chunk_bytes
                staging[:n] = view[start : start + n]
                header.set_slot_freed(slot, header.slot_taken(slot))
            header[Word.PERSISTED_UPTO] = chunk.index + 1
            data = staging[:n]
            crcs[chunk.tensor_index] = crc32(data, crcs[chunk.tensor_index])
            while data:
                data = data[os.write(fd, data) :]
            self.bytes_persisted += n
        return crcs

    def _tensor_records(self, offsets: list[tuple[int, int]], crcs: list[int]) -> tuple[TensorRecord, ...]:
        records = []
        for tensor, (begin, end), value in zip(self.source.layout.tensors, offsets, crcs):
            meta = self.metadata.tensors.get(tensor.name, TensorMetadata())
            records.append(
                TensorRecord(
                    name=tensor.name,
                    dtype=tensor.dtype,
                    shape=tensor.shape,
                    nbytes=tensor.nbytes,
                    data_offsets=(begin, end),
                    crc32=value,
                    fqn=meta.fqn,
                    key=meta.key,
                    global_shape=meta.global_shape,
                    global_offset=meta.global_offset,
                )
            )
        return tuple(records)

    def run(self) -> RankResult:
        """Persist; in the writer thread. Raises Cancelled or SnapshotError; the segment is
        released (``segment_released`` set) before this returns or raises."""
        source = self.source
        layout = source.layout
        data_name = rank_data_name(source.rank)
        data_path = self.partial_dir / data_name
        header_bytes, offsets = safetensors_header(
            [(t.name, t.dtype, t.shape, t.nbytes) for t in layout.tensors],
            safetensors_metadata(source.job_id, source.step, source.rank, source.world_size),
        )
        action = f"writing {data_path.name} of {source.job_id}/step-{source.step}"
        try:
            try:
                fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    view = memoryview(header_bytes)
                    while view:
                        view = view[os.write(fd, view) :]
                    segment = memoryview(source.buffer)
                    try:
                        crcs = self._stream(fd, segment)
                    finally:
                        segment.release()  # the caller's mmap cannot close while it exists
                        self.release_segment()
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                self.release_segment()  # also when open() or the header write failed
            file_crc = crc32(header_bytes)
            for tensor, value in zip(layout.tensors, crcs):
                file_crc = crc32_combine(file_crc, value, tensor.nbytes)
            data_record = FileRecord(data_name, source.rank, len(header_bytes) + self.bytes_total, file_crc)
            cow_copies, bp_waits, bp_wait_ns = self.counters()
            manifest = RankManifest(
                job_id=source.job_id,
                step=source.step,
                rank=source.rank,
                world_size=source.world_size,
                data_file=data_name,
                data_file_bytes=data_record.bytes,
                data_start=len(header_bytes),
                chunk_bytes=layout.chunk_bytes,
                tensors=self._tensor_records(offsets, crcs),
                param_groups=self.metadata.param_groups,
                steps=self.metadata.steps,
                metadata_json=self.metadata.raw,
                cow_copies=cow_copies,
                backpressure_waits=bp_waits,
                backpressure_wait_seconds=bp_wait_ns / 1e9,
                persist_seconds=time.monotonic() - self.started_monotonic,
            )
            action = f"writing {rank_manifest_name(source.rank)} of {source.job_id}/step-{source.step}"
            raw = dumps_json(manifest.to_json())
            write_durable(self.partial_dir / rank_manifest_name(source.rank), raw)
        except OSError as exc:
            raise from_os_error(exc, action, self.snapshot_root) from None
        manifest_record = FileRecord(rank_manifest_name(source.rank), source.rank, len(raw), crc32(raw))
        return RankResult(manifest, (data_record, manifest_record))
