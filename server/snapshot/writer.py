"""The server's side of the copy-before-write protocol: persist one rank's segment, and stage
the chunks the trainer would reach first (:mod:`swap_state.common.segment`, steps 1-3).

Call order (the coordinator does this, :mod:`swap_state.server.snapshot.coordinator`):

1. ``RankWriter(...)`` then, synchronously in the Snapshot call, :meth:`RankWriter.publish`:
   frees leftover copy slots, stores ``SNAP_STEP``, ``PERSISTED_UPTO = 0``, ``STAGED_UPTO =
   0``, ``STAGE_SLOTS = k`` and last ``SNAP_EPOCH = e``. From its return the snapshot is
   *consistent*.
2. :meth:`RankWriter.run` in a background thread. Once let go (:meth:`RankWriter.go`) it
   starts a :class:`~.snapshot_stager.Stager` thread, which copies chunks in update order into the stager's
   ``k`` slots (a ring, ``ctypes.memmove`` with the GIL released, ``stage_threads`` threads)
   as far ahead of the writer as the ring allows and publishes ``STAGED_UPTO``: so the
   trainer's next optimizer step finds them safe instead of copying them itself. The writer
   yields to a stager that can still copy (:meth:`Stager.yield_to`: its copies are the
   urgent ones, and the writer then reads the staged chunks from the slots), and once every
   chunk is staged, to the trainer's optimizer steps (:meth:`RankWriter._yield_to_trainer`:
   it persists during forward/backward instead); otherwise ``run`` streams the chunks in update order into ``rank-XXXXX.safetensors`` in the partial
   directory, from the stager's slot when the chunk is staged, else straight from the
   segment (``os.pwrite`` of a memoryview, no copy of its own), storing ``PERSISTED_UPTO =
   c + 1`` as soon as chunk c is in the page cache and checksummed (before it reaches the
   disk, so the trainer is held up by memory speed and the bandwidth cap, not by the disk;
   the kernel's dirty-page throttling can still slow a pwrite on a snapshot many GB large);
   then stops the stager, releases the segment (``SNAP_EPOCH = 0``), fsyncs the file and
   writes the rank manifest. On any error or cancellation the stager is stopped and the
   segment released all the same (its tensor area is only ever read, never written; the
   server writes only its header words and its slots), and the error propagates.

Bytes never leave through anything but this file; the segment's tensor area is read-only here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading
import time
from typing import Any

from swap_state.common.segment import (
    SegmentHeader,
    SegmentLayout,
    Word,
    chunk_table,
    first_model_chunk,
    stager_slot_count,
)

from swap_state.common.checksum import crc32, crc32_combine
from swap_state.common.snapshot_errors import SnapshotError, from_os_error
from swap_state.common.snapshot_format import (
    FileRecord,
    RankManifest,
    TensorRecord,
    dumps_json,
    rank_data_name,
    rank_manifest_name,
    safetensors_header,
    safetensors_metadata,
)
from swap_state.common.snapshot_metadata import SnapshotMetadata, TensorMetadata
from swap_state.common.retry import wait_until
from swap_state.common.server_header import ServerHeader
from swap_state.server import _posix
from swap_state.server.snapshot.stager import Stager
from swap_state.server.snapshot.store import write_durable

__all__ = ["BandwidthLimiter", "Cancelled", "RankResult", "RankWriter", "SnapshotSource"]

log = logging.getLogger("swap_state.server.snapshot_writer")

HOLD_MAX_S = 0.25
"""How long a writer started with ``hold`` waits for :meth:`RankWriter.go` at most."""

_WRITEBACK_BYTES = 8 << 20
"""Start the disk writeback of every this many streamed bytes (see :func:`_start_writeback`)."""


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``data`` is at ``offset`` (it may write short). Releases
    the GIL for the copy into the page cache."""
    done = 0
    total = data.nbytes
    while done < total:
        if done:
            with data[done:] as rest:
                done += os.pwrite(fd, rest, offset + done)
        else:
            done += os.pwrite(fd, data, offset)


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


TRAINER_YIELD_MAX_S = 2.0
"""Longest a writer with nothing left at risk pauses for one optimizer step of the trainer
(``WRITING_STEP`` set); a step that takes longer (a trainer killed mid-step, say) ends the
pausing for the rest of the snapshot (see :meth:`RankWriter._yield_to_trainer`)."""

TRAINER_YIELD_SHARE = 0.5
"""Most of its streaming time a writer spends paused for the trainer's steps: a trainer
whose steps leave little time between them delays durability by 2x at most."""



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
    """Ranks of the job (global, across hosts); recorded in the snapshot, checked on restore."""
    step: int
    """The committed step the segment holds (the caller checks it is the last committed)."""
    metadata_json: str = ""
    """The trainer's description of the tensors (``snapshot_metadata`` schema); may be empty."""
    local_world_size: int = 0
    """Ranks of the job on this server (this host), 1..world_size; 0 means ``world_size``.
    This server's snapshot is complete when this many distinct ranks are durable."""
    keep_latest: int = 0
    """Durable snapshots the job asks to keep (its own checkpoint retention); the server keeps
    at least its ``--keep-latest``. 0: just that."""
    keep_all: bool = False
    """The job keeps every checkpoint: retention removes none of its snapshots."""
    replace_existing: bool = False
    """A durable snapshot of this step from an earlier attempt is replaced (atomically, once
    the new one is durable) instead of refused."""

    @property
    def expected_ranks(self) -> int:
        """The number of ranks this server's snapshot of the step waits for."""
        return self.local_world_size or self.world_size


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
        stage_threads: int = 1,
        model_copy_timeout_s: float = 60.0,
    ):
        """``stage_threads``: threads of the :class:`Stager` (0: no staging, the trainer
        copies every chunk the writer has not reached, as before the stager existed).
        ``model_copy_timeout_s``: how long the writer waits for the trainer's copy of the
        model tensors of the step (protocol step 5) before the snapshot fails."""
        self.source = source
        self.metadata = metadata
        self.epoch = epoch
        self.partial_dir = partial_dir
        self.limiter = limiter
        self.cancel = cancel
        self.snapshot_root = snapshot_root
        self.started_monotonic = started_monotonic
        layout = source.layout
        self._header = ServerHeader(source.header)
        """The server's writes to the segment's header (protocol steps 1 and 3)."""
        self.chunks = chunk_table(layout.tensors, layout.chunk_bytes)
        self.model_from = first_model_chunk(layout.tensors, layout.chunk_bytes)
        """The first chunk of the model tensors (the chunk count when there are none)."""
        self.model_copy_timeout_s = model_copy_timeout_s
        self.model_wait_seconds = 0.0
        """How long the writer waited for the trainer's copy of the model (writer thread)."""
        self.bytes_total = sum(t.nbytes for t in layout.tensors)
        self.bytes_persisted = 0  # written by the writer thread only
        self.trainer_copied_bytes = 0  # chunks the trainer copied itself (writer thread)
        self.stream_seconds = 0.0  # time spent streaming the chunks (writer thread)
        self.stage_threads = stage_threads
        self.stage_slots = stager_slot_count(source.layout.cow_slots) if stage_threads > 0 else 0
        self.stager: Stager | None = (
            Stager(self, self.stage_slots, stage_threads) if self.stage_slots else None
        )
        self._trainer_yield = self.stager is not None
        self._paused_s = 0.0  # time the writer paused for the trainer's steps (writer thread)
        self._stream_started = 0.0
        self.segment_released = threading.Event()
        self.go_event = threading.Event()
        """Set: ``run`` may start streaming (see :meth:`go`)."""
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

    def server_counters(self) -> tuple[int, int, int]:
        """(chunks the stager copied, their bytes, bytes the trainer copied itself) so far."""
        stager = self.stager
        if stager is None:
            return (0, 0, self.trainer_copied_bytes)
        return (stager.staged_chunks, stager.staged_bytes, self.trainer_copied_bytes)

    def persist_rate(self) -> float | None:
        """Bytes/s the chunks streamed at (page cache, checksummed; what moves
        ``PERSISTED_UPTO``), once done; None before."""
        if not self.segment_released.is_set() or self.stream_seconds <= 0 or not self.bytes_persisted:
            return None
        return self.bytes_persisted / self.stream_seconds

    # --------------------------------------------------------------------- protocol

    def publish(self) -> None:
        """Make the snapshot consistent: after this the trainer may mutate the segment."""
        # Every slot is freed first: a trainer that checked PERSISTED_UPTO <= c just before
        # the server stored c + 1 takes a slot whose COW_EPOCH the server never sees, so never
        # frees; such slots are reclaimed whenever no trainer can be taking one for a live
        # epoch, i.e. before SNAP_EPOCH is published and after it is cleared.
        self._header.open_snapshot(self.source.step, self.stage_slots, self.epoch, self.source.layout.cow_slots)

    def go(self) -> None:
        """Let ``run`` start streaming. The coordinator sets it at once, unless the caller
        asked to *hold* the writer until its reply is out (the Snapshot RPC does: the reply is
        the trainer's stall, and a writer already streaming competes with it for the GIL and
        the CPUs). Holding is safe at any length: the snapshot is consistent from
        :meth:`publish` on, a late writer only means the trainer copies more chunks first.
        ``run`` waits ``HOLD_MAX_S`` at most, should nobody call this."""
        self.go_event.set()

    def release_segment(self) -> None:
        """Clear the epoch (the trainer stops copying), free every slot, freeze the counters.
        Idempotent; ``run`` calls it on every path, the coordinator only if ``run`` never ran."""
        if self.segment_released.is_set():
            return
        if self.stager is not None:
            self.stager.stop()  # no stager store after the epoch ends
        self._header.close_snapshot(self.source.layout.cow_slots)
        self._final = self.counters()
        self.segment_released.set()

    # --------------------------------------------------------------------- whole state

    def model_published(self) -> bool:
        """Whether the trainer has copied the model tensors of the snapshot's step (or a
        later one, whose copy protected this step's bytes first): protocol step 5."""
        return self.source.header[Word.MODEL_STEP] >= self.source.step + 1

    def _wait_for_model(self) -> None:
        """Before the first model chunk: wait (bounded, cancellable) for protocol step 5."""
        began = time.monotonic()

        def nap(seconds: float) -> None:
            if self.cancel.wait(seconds):
                raise Cancelled()

        published = wait_until(
            self.model_published, timeout_s=self.model_copy_timeout_s, first_s=1e-4, max_s=0.01, sleep=nap
        )
        self.model_wait_seconds += time.monotonic() - began
        if not published:
            copied = self.source.header[Word.MODEL_STEP]
            raise SnapshotError(
                f"the trainer did not copy the model's parameters of step "
                f"{self.source.step} into its segment within {self.model_copy_timeout_s:g} s "
                f"(it has copied {f'those of step {copied - 1}' if copied else 'none'}); "
                "a trainer that stopped or died after the step cannot complete the snapshot "
                "(server flag --model-copy-timeout)"
            )

    # --------------------------------------------------------------------- persisting

    def _yield_to_trainer(self, n_chunks: int) -> None:
        """Once every chunk is staged (``STAGED_UPTO == n``), the trainer needs nothing more
        from the writer: pause while it writes a step (``WRITING_STEP`` set), so that its
        optimizer step, bound by host memory bandwidth (on a GPU host: its H2D/D2H copies),
        does not share it with the writer's pwrite into the page cache, its crc32 and the
        kernel's writeback; persist during the forward/backward instead. Bounded by
        ``TRAINER_YIELD_MAX_S`` per step."""
        header = self.source.header
        if not self._trainer_yield or header[Word.STAGED_UPTO] < n_chunks:
            return
        writing = header[Word.WRITING_STEP]
        if not writing:
            return
        began = time.monotonic()
        deadline = began + TRAINER_YIELD_MAX_S
        try:
            while header[Word.WRITING_STEP] == writing:
                now = time.monotonic()
                if now >= deadline:
                    self._trainer_yield = False  # a stuck step: stop pausing for it
                    return
                if self._paused_s + (now - began) > TRAINER_YIELD_SHARE * (now - self._stream_started):
                    return  # durability must not wait on the trainer's pace for ever
                if self.cancel.wait(0.001):
                    return
        finally:
            self._paused_s += time.monotonic() - began

    def _stream(self, fd: int, view: memoryview, data_start: int) -> list[int]:
        """Write every chunk (from the segment, its stager slot or the trainer's slot) to
        ``fd`` at its place after the safetensors header; per-tensor crc32s.

        Zero-copy and GIL-friendly: ``os.pwrite`` copies from the mapped segment into the
        page cache and ``crc32`` (:mod:`swap_state.common.checksum`: ISA-L, or zlib)
        checksums the same memoryview, both with the GIL released (the loop itself only
        slices views and reads header words), so the event loop answers RPCs while a
        snapshot streams.

        Why this stays exact (step N's bytes, bit for bit, in the file and in the crc):
        while chunk c is being written and checksummed here, ``PERSISTED_UPTO <= c`` (it is
        stored only after the checks below), so the trainer overwrites chunk c in this epoch
        only after its own copy into a slot of its own with ``COW_EPOCH[c] = e`` stored
        first, or after the stager published ``STAGED_UPTO > c`` (stored once its copy of c
        ended; protocol steps 2 and 4). The source read first is the stager slot when
        ``STAGED_UPTO > c`` already (its bytes are step N's unless the trainer had copied
        the chunk first, which the next check sees), else the segment. Then:

        - ``COW_EPOCH[c] == e`` *after* both reads: the trainer's slot holds step N's bytes
          (copied before its first overwrite) and what was read may be torn, so both the
          pwrite and the crc are redone from that slot: all ``n`` bytes over the same file
          range (nothing of the first write survives), the crc continuing the tensor's
          running crc from before the chunk. The slot is then freed.
        - else, read from the segment and now ``STAGED_UPTO > c``: the stager copied the
          chunk meanwhile (cleanly: the trainer's copy did not exist) and the trainer may
          have overwritten it since: both are redone from the stager slot.
        - else: no overwrite of chunk c began before the checks, so the pwrite and the
          crc32 saw step N's bytes, the same bytes.
        """
        layout = self.source.layout
        header = self.source.header
        stager = self.stager
        ring = self.stage_slots
        slots_at = layout.cow_slots_offset
        crcs = [0] * len(layout.tensors)
        position = data_start
        kicked = 0  # file bytes [0, kicked) have had writeback started
        started = self._stream_started = time.monotonic()
        try:
            for chunk in self.chunks:
                if chunk.index == self.model_from:
                    self._wait_for_model()
                if stager is not None:
                    stager.yield_to()
                    self._yield_to_trainer(len(self.chunks))
                if not self.limiter.acquire(chunk.nbytes, self.cancel):
                    raise Cancelled()
                n = chunk.nbytes
                c = chunk.index
                before = crcs[chunk.tensor_index]
                staged = ring > 0 and c < header[Word.STAGED_UPTO]
                stage_at = slots_at + (c % ring) * layout.chunk_bytes if ring else 0
                start = stage_at if staged else chunk.offset
                with view[start : start + n] as data:
                    _pwrite_all(fd, data, position)
                    value = crc32(data, before)
                redo = None
                trainer_slot = None
                if header.cow_epoch(c) == self.epoch:
                    trainer_slot = header.cow_slot(c) - 1
                    if not ring <= trainer_slot < layout.cow_slots:
                        raise SnapshotError(
                            f"trainer published copy slot {trainer_slot} for chunk {c}; its "
                            f"slots are [{ring}, {layout.cow_slots})"
                        )
                    redo = slots_at + trainer_slot * layout.chunk_bytes
                    self.trainer_copied_bytes += n
                elif not staged and ring and c < header[Word.STAGED_UPTO]:
                    redo = stage_at
                if redo is not None:
                    # Not charged to the limiter again: the trainer may be waiting on this
                    # chunk, and the disk sees the range once (the same dirty pages, rewritten).
                    with view[redo : redo + n] as data:
                        _pwrite_all(fd, data, position)  # the same range: replaces every byte
                        value = crc32(data, before)
                if trainer_slot is not None:
                    self._header.free_slot(trainer_slot)
                self._header.persisted(c + 1)  # also frees the chunk's stager slot
                if stager is not None:
                    stager.wake()
                crcs[chunk.tensor_index] = value
                position += n
                self.bytes_persisted += n
                if position - kicked >= _WRITEBACK_BYTES:
                    _posix.start_writeback(fd, kicked, position - kicked)
                    kicked = position
        finally:
            self.stream_seconds = time.monotonic() - started
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
        self.go_event.wait(HOLD_MAX_S)
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
                        if self.stager is not None and not self.cancel.is_set():
                            self.stager.start(segment)
                        crcs = self._stream(fd, segment, len(header_bytes))
                    finally:
                        if self.stager is not None:
                            self.stager.stop()  # before the view goes: it copies from it
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
