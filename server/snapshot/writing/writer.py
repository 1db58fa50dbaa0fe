"""The server's side of the copy-before-write protocol: persist one rank's segment, and stage
the chunks the trainer would reach first (:mod:`swap_state.common.segment`, steps 1-3).

Call order (the coordinator): ``RankWriter(...)``; :meth:`RankWriter.publish` in the Snapshot call
(from its return the snapshot is *consistent*); :meth:`RankWriter.run` in a background thread,
which streams once let go (:meth:`RankWriter.go`). The segment's tensor area is only read here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import struct
import threading
import time

from swap_state.common.segment import Chunk, Word, stager_slot_count
from swap_state.common.server_config import SnapshotSettings
from swap_state.common.checksum import BlockChecksum, crc32, crc32_combine
from swap_state.common.snapshot_errors import SnapshotError, from_os_error
from swap_state.common.snapshot_format import (
    FileRecord, RankManifest, TensorRecord, checksum_block_bytes, rank_data_name, rank_manifest_name,
    safetensors_header, safetensors_metadata)
from swap_state.common.snapshot_metadata import EMPTY_METADATA, TensorMetadata
from swap_state.common.retry import wait_until
from swap_state.common.server_header import ServerHeader
from swap_state.server.logs import log_event
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter
from swap_state.server.snapshot.tiers.seam import StepWrite, TierWriter
from swap_state.server.snapshot.writing.source import SnapshotSource
from swap_state.server.snapshot.writing.copy_ahead import Stager
from swap_state.server.snapshot.writing.sink import ChunkSink
from swap_state.server.snapshot.waiting import Latch

__all__ = ["Cancelled", "RankResult", "RankWriter"]

log = logging.getLogger(__name__)

HOLD_MAX_S = 0.25  # how long a writer started with ``hold`` waits for RankWriter.go at most


def _place(sink: ChunkSink, data: memoryview, stable: bool) -> memoryview:
    """``sink.put``: a module name, so that tests can race the trainer against the read."""
    return sink.put(data, stable)


# The most bytes of a chunk placed, checksummed (and sent to a replica peer) at once: the passes after the
# placing then read the piece from the CPU's cache, not from memory (docs/benchmarks.md, "Pieces the cache holds").
PIECE_BYTES = 256 << 10

# Longest a writer pauses for one optimizer step of the trainer; a longer step (a trainer killed mid-step)
# ends the pausing for the rest of the snapshot.
TRAINER_YIELD_MAX_S = 2.0
# Most of its streaming time a writer spends paused for the trainer's steps: a trainer whose steps leave
# little time between them delays durability by 2x at most.
TRAINER_YIELD_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class RankResult:
    """A rank whose data file and manifest are written and fsynced."""

    manifest: RankManifest
    files: tuple[FileRecord, FileRecord]  # (data file, manifest file) with sizes and crc32s, for snapshot.json


class Cancelled(Exception):
    """The snapshot was cancelled (another rank failed, timeout, shutdown) while persisting."""


class RankWriter:
    """Persists one rank's segment; one instance per rank and snapshot."""

    def __init__(self, source: SnapshotSource, epoch: int,
                 tier: TierWriter, target: StepWrite, limiter: BandwidthLimiter,
                 cancel: threading.Event, started_monotonic: float, settings: SnapshotSettings):
        self.source, self.epoch = source, epoch
        self.metadata = EMPTY_METADATA  # expanded from the source's parts in run(), after the stall
        self.tier, self.target, self.limiter, self.cancel = tier, target, limiter, cancel
        self.started_monotonic = started_monotonic
        layout = source.layout
        self._header = ServerHeader(source.header)  # the server's words (protocol steps 1 and 3)
        self.chunks = layout.chunks
        self.model_from = layout.model_from  # the first model chunk (the chunk count when there are none)
        self.model_copy_timeout_s = settings.model_copy_timeout_s
        self.bytes_total = layout.tensor_bytes
        # Written by the writer thread only: bytes persisted, of the chunks the trainer copied
        # itself, and the time spent streaming the chunks.
        self.bytes_persisted = self.trainer_copied_bytes = 0
        self.stream_seconds = 0.0
        self.stage_slots = stager_slot_count(source.layout.cow_slots)
        self.stager = Stager(self, self.stage_slots, settings.stage_threads) if self.stage_slots else None
        self._trainer_yield = self.stager is not None
        self._in_file = False  # the stager copies into the file (a memory-only snapshot's): the writer follows it
        self.direct_io = False  # whether the data file was written with O_DIRECT (known once it is created)
        self._paused_s = 0.0  # time the writer paused for the trainer's steps (writer thread)
        self._stream_started = 0.0
        self.segment_released = Latch()
        self.go_event = threading.Event()
        header = source.header
        self._base = (header[Word.COW_COPIES], header[Word.BP_WAITS], header[Word.BP_WAIT_NS])
        self._final: tuple[int, int, int] | None = None

    def counters(self) -> tuple[int, int, int]:
        """(cow copies, back-pressure waits, wait ns) of this snapshot: live while the
        segment is held, frozen from its release on (the segment may be gone after that)."""
        if self._final is not None:
            return self._final
        header = self.source.header
        now = (header[Word.COW_COPIES], header[Word.BP_WAITS], header[Word.BP_WAIT_NS])
        return (now[0] - self._base[0], now[1] - self._base[1], now[2] - self._base[2])

    def server_counters(self) -> tuple[int, int, int]:
        """(chunks the stager copied, their bytes, bytes the trainer copied itself) so far."""
        stager = self.stager
        return (stager.staged_chunks if stager else 0, stager.staged_bytes if stager else 0, self.trainer_copied_bytes)

    def persist_rate(self) -> float | None:
        """Bytes/s the chunks streamed at (what moves ``PERSISTED_UPTO``), once done; None before."""
        if not self.segment_released.is_set() or self.stream_seconds <= 0 or not self.bytes_persisted:
            return None
        return self.bytes_persisted / self.stream_seconds

    def publish(self) -> None:
        """Make the snapshot consistent: after this the trainer may mutate the segment."""
        # Every slot is freed first: a trainer that checked PERSISTED_UPTO <= c just before the server stored c + 1
        # takes a slot whose COW_EPOCH the server never sees, so never frees; such slots are reclaimed whenever no
        # trainer can be taking one for a live epoch, i.e. before SNAP_EPOCH is published and after it is cleared.
        self._header.open_snapshot(self.source.step, self.stage_slots, self.epoch, self.source.layout.cow_slots)

    def go(self) -> None:
        """Let ``run`` stream: the Snapshot RPC holds it until its reply is out, so the writer does not
        compete with it for the GIL (``run`` waits ``HOLD_MAX_S`` at most)."""
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

    def model_published(self) -> bool:
        """Protocol step 5: the trainer has copied the model tensors of the step (or a later one)."""
        return self.source.header[Word.MODEL_STEP] >= self.source.step + 1

    def _wait_for_model(self) -> None:
        def nap(seconds: float) -> None:
            if self.cancel.wait(seconds):
                raise Cancelled()

        published = wait_until(self.model_published, timeout_s=self.model_copy_timeout_s, first_s=1e-4, max_s=0.01,
                               sleep=nap)
        if not published:
            copied = self.source.header[Word.MODEL_STEP]
            raise SnapshotError("the trainer did not copy the model's parameters of step "
                                f"{self.source.step} into its segment within {self.model_copy_timeout_s:g} "
                                f"s (it has copied {f'those of step {copied - 1}' if copied else 'none'}); "
                                "a trainer that stopped or died after the step cannot complete the snapshot "
                                "(server flag --model-copy-timeout)")

    def _yield_to_trainer(self, n_chunks: int) -> None:
        """Once every chunk is staged, pause while the trainer writes a step (``WRITING_STEP``):
        its optimizer step is bound by host memory bandwidth, which the writer's pwrite, crc32
        and writeback would share; persist during forward/backward instead."""
        header = self.source.header
        if not self._trainer_yield or header[Word.STAGED_UPTO] < n_chunks or not (writing := header[Word.WRITING_STEP]):
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

    def _stream(self, sink: ChunkSink, view: memoryview) -> list[BlockChecksum]:
        """Put every chunk into ``sink`` after the header, in file order; per-tensor checksums.
        The sink's copies and crc32 release the GIL, so the event loop answers RPCs meanwhile."""
        checksums = [BlockChecksum(checksum_block_bytes(t.nbytes)) for t in self.source.layout.tensors]
        started = self._stream_started = time.monotonic()
        try:
            for chunk in self.chunks:
                self._before_chunk(chunk, sink)
                self._persist_chunk(sink, view, chunk, checksums[chunk.tensor_index])
                self.bytes_persisted += chunk.nbytes
            self._check_not_abandoned()  # after the last read: protocol step 6
        finally:
            self.stream_seconds = time.monotonic() - started
        return checksums

    def _before_chunk(self, chunk: Chunk, sink: ChunkSink) -> None:
        """Wait until ``chunk`` may be streamed (the model's copy, the stager, the trainer's step,
        the bandwidth cap); Cancelled when the snapshot was cancelled meanwhile."""
        self._check_not_abandoned()
        if chunk.index == self.model_from:
            self._wait_for_model()
        if self.stager is not None:
            if sink.stager_first and not self._in_file:
                self.stager.yield_to()
            self._yield_to_trainer(len(self.chunks))
        if not self.limiter.acquire(chunk.nbytes, self.cancel):
            raise Cancelled()

    def _check_not_abandoned(self) -> None:
        """Protocol step 6: the trainer gave this epoch up, so what was read may be torn."""
        if self.source.header[Word.ABANDONED_EPOCH] == self.epoch:
            raise SnapshotError(f"the trainer of {self.source.job_id} rank {self.source.rank} gave this "
                                "snapshot up: it found the server unreachable (its KeepAlive stream broke) "
                                "and overwrote chunks without a copy; take the snapshot again")

    def _persist_chunk(self, sink: ChunkSink, view: memoryview, chunk: Chunk, checksum: BlockChecksum) -> None:
        """Put ``chunk`` into ``sink``, piece by piece, into its tensor's ``checksum``, and publish
        ``PERSISTED_UPTO = c + 1``.

        Why this stays exact: while chunk c is read, ``PERSISTED_UPTO <= c``, so the trainer overwrites c only after its
        own copy into a slot with ``COW_EPOCH[c] = e`` stored first, or after the stager published ``STAGED_UPTO > c``
        (protocol steps 2 and 4). The first source is the stager slot when already ``STAGED_UPTO > c``, else the
        segment. After each piece is placed (and checksummed), :meth:`_safe_source` reads those words again:

        - ``COW_EPOCH[c] == e``: the trainer's slot holds step N's bytes and this piece may be
          torn: it and the rest of the chunk are placed again from that slot (the checksum
          rewound to before the piece); the slot is freed after.
        - else, read from the segment and now ``STAGED_UPTO > c``: the stager copied the chunk
          cleanly meanwhile: the piece and the rest come from its slot.
        - else: no overwrite of c began before the check: the piece is step N's bytes.

        A piece is final (the sink may write it to disk) only after its check.
        """
        n, c = chunk.nbytes, chunk.index
        layout, ring = self.source.layout, self.stage_slots  # where the stager stages chunk c, if any
        stage_at = layout.cow_slots_offset + (c % ring) * layout.chunk_bytes if ring and not self._in_file else None
        if self._in_file and self.stager.wait_staged(c) and self.source.header.cow_epoch(c) != self.epoch:
            return self._persist_staged(sink, chunk, checksum)  # else the trainer's slot, or the stager ended
        source = stage_at if stage_at is not None and c < self.source.header[Word.STAGED_UPTO] else chunk.offset
        trainer_slot: int | None = None
        done = 0
        while done < n:
            size, before = min(n - done, sink.room(), PIECE_BYTES), checksum.mark()
            stable = source != chunk.offset  # a slot holds until c is persisted; the trainer writes the segment
            with view[source + done : source + done + size] as data, _place(sink, data, stable) as placed:
                checksum.update(placed)
            safe, slot = self._safe_source(chunk, source, stage_at)
            if safe != source:  # not charged to the limiter again: the trainer may be waiting
                source, trainer_slot = safe, slot
                checksum.rewind(before)
                with view[source + done : source + done + size] as data, sink.replace(data, stable=True) as placed:
                    checksum.update(placed)
            sink.advance()
            done += size
        if trainer_slot is not None:
            self.trainer_copied_bytes += n
            self._header.free_slot(trainer_slot)
        self._header.persisted(c + 1)  # also frees the chunk's stager slot
        if self.stager is not None:
            self.stager.wake()

    def _persist_staged(self, sink: ChunkSink, chunk: Chunk, checksum: BlockChecksum) -> None:
        """``chunk``, which the stager copied into the file before the trainer wrote it (no ``COW_EPOCH`` of this
        epoch once ``STAGED_UPTO`` passed it): checksummed and made final (sent) where it lies, piece by piece."""
        done = 0
        while done < chunk.nbytes:
            with sink.put_mapped(min(chunk.nbytes - done, sink.room(), PIECE_BYTES)) as placed:
                checksum.update(placed)
                done += placed.nbytes
            sink.advance()
        self._header.persisted(chunk.index + 1)

    def _safe_source(self, chunk: Chunk, source: int, stage_at: int | None) -> tuple[int, int | None]:
        """After a piece of ``chunk`` was read from ``source``: (where its step-N bytes are now,
        the trainer's slot holding them or None). See :meth:`_persist_chunk`."""
        layout, header = self.source.layout, self.source.header
        c = chunk.index
        if header.cow_epoch(c) == self.epoch:
            trainer_slot = header.cow_slot(c) - 1
            if not self.stage_slots <= trainer_slot < layout.cow_slots:
                raise SnapshotError(f"trainer published copy slot {trainer_slot} for chunk {c}; its slots "
                                    f"are [{self.stage_slots}, {layout.cow_slots})")
            return layout.cow_slots_offset + trainer_slot * layout.chunk_bytes, trainer_slot
        if source == chunk.offset and stage_at is not None and c < header[Word.STAGED_UPTO]:
            return stage_at, None
        return source, None

    def run(self) -> RankResult:
        """Persist; in the writer thread. Raises Cancelled or SnapshotError; the segment is
        released (``segment_released`` set) before this returns or raises."""
        self.go_event.wait(HOLD_MAX_S)
        source = self.source
        if source.metadata_parts is not None:
            self.metadata = source.metadata_parts.expand()  # per-tensor work: here, not in the RPC
        tensors = source.layout.tensors
        header, offsets = safetensors_header(
            [(t.name, t.dtype, t.shape, t.nbytes) for t in tensors],
            safetensors_metadata(source.job_id, source.step, source.rank, source.world_size))
        data_name, manifest_name = rank_data_name(source.rank), rank_manifest_name(source.rank)
        action = f"writing {data_name} of {source.job_id}/step-{source.step}"
        try:
            try:
                checksums = self._write_data_file(data_name, header)
            finally:
                self.release_segment()  # also when the file could not be created
            sums = [(checksum.block_bytes, *checksum.finish()) for checksum in checksums]
            file_crc = crc32(header)  # combined from the tensors' crc32s
            for tensor, (_, value, _) in zip(tensors, sums):
                file_crc = crc32_combine(file_crc, value, tensor.nbytes)
            data = FileRecord(data_name, source.rank, len(header) + self.bytes_total, file_crc)
            manifest = self._manifest(sums, offsets, data, len(header))
            action = f"writing {manifest_name} of {source.job_id}/step-{source.step}"
            raw = manifest.to_bytes()
            self.tier.write_file(self.target, manifest_name, raw)
            files = (data, FileRecord(manifest_name, source.rank, len(raw), crc32(raw)))
            self.tier.finish_rank(self.target, source.rank, files)
        except OSError as exc:
            raise from_os_error(exc, action, self.tier.root) from None
        rate = self.persist_rate()
        log_event(log, "snapshot_rank_persisted", job_id=source.job_id, step=source.step, rank=source.rank,
                  bytes=self.bytes_persisted, stream_seconds=round(self.stream_seconds, 4),
                  stream_gbps=round(rate / 1e9, 3) if rate else None, direct_io=self.direct_io,
                  trainer_copied_bytes=self.trainer_copied_bytes,
                  staged_bytes=self.stager.staged_bytes if self.stager is not None else 0)
        return RankResult(manifest, files)

    def _manifest(self, sums: list[tuple[int, int, list[int]]], offsets: list[tuple[int, int]], data: FileRecord,
                  data_start: int) -> RankManifest:
        """The rank's manifest: each tensor's place, ``sums`` (block size, crc32, blocks') and metadata."""
        source, metadata = self.source, self.metadata
        records = []
        for tensor, (begin, end), (block_bytes, value, blocks) in zip(source.layout.tensors, offsets, sums):
            meta = metadata.tensors.get(tensor.name, TensorMetadata())
            records.append(TensorRecord(
                name=tensor.name, dtype=tensor.dtype, shape=tensor.shape, nbytes=tensor.nbytes,
                data_offsets=(begin, end), crc32=value, fqn=meta.fqn, key=meta.key,
                global_shape=meta.global_shape, global_offset=meta.global_offset,
                block_bytes=block_bytes, block_crcs=struct.pack(f"<{len(blocks)}I", *blocks)))
        cow_copies, bp_waits, bp_wait_ns = self.counters()
        return RankManifest(job_id=source.job_id, step=source.step, rank=source.rank, world_size=source.world_size,
                            data_file=data.name, data_file_bytes=data.bytes, data_start=data_start,
                            chunk_bytes=source.layout.chunk_bytes, tensors=tuple(records),
                            param_groups=metadata.param_groups, steps=metadata.steps, metadata_extra=metadata.extra,
                            cow_copies=cow_copies, backpressure_waits=bp_waits,
                            backpressure_wait_seconds=bp_wait_ns / 1e9,
                            persist_seconds=time.monotonic() - self.started_monotonic)

    def _write_data_file(self, name: str, header: bytes) -> list[BlockChecksum]:
        """Start the stager, create the data file, put its header, stream the chunks, release the
        segment, write the rest and fsync; the tensors' checksums."""
        segment = memoryview(self.source.buffer)
        with contextlib.ExitStack() as opened:
            try:
                into_file = self.stager is not None and self.source.memory_only
                if self.stager is not None and not into_file and not self.cancel.is_set():
                    # Before the file: opening it may wait on a replica peer, and the trainer's
                    # next step must find its chunks staged meanwhile.
                    self.stager.start(segment)
                sink = opened.enter_context(self.tier.open_file(self.target, name))
                self.direct_io = sink.direct
                if into_file and not self.cancel.is_set():
                    self._start_stager_into(sink, segment, len(header))
                sink.write_all(header)
                crcs = self._stream(sink, segment)
            finally:
                if self.stager is not None:
                    self.stager.stop()  # before the view goes: it copies from it
                segment.release()  # the caller's mmap cannot close while it exists
                self.release_segment()
            sink.finish()
        return crcs

    def _start_stager_into(self, sink: ChunkSink, segment: memoryview, header_bytes: int) -> None:
        """A memory-only snapshot's stager: each chunk into its place in the file, mapped (into slots where the sink
        cannot map it)."""
        address = sink.map(header_bytes + sum(chunk.nbytes for chunk in self.chunks))
        self._in_file = address is not None
        # The file holds the chunks in order after the header.
        places = list(itertools.accumulate((c.nbytes for c in self.chunks[:-1]), initial=address + header_bytes)) \
            if address is not None else None
        self.stager.start(segment, places)
