"""The write seam of the snapshot tiers (:class:`TierWriter`, modelled on DCP's ``StorageWriter``:
prepare, write, finish), beside the read seam (:class:`~swap_state.common.snapshot_tier.SnapshotTier`):
the local directory (:mod:`.directory`) and the store (:mod:`.store`, written by :func:`copy_rank`).
"""

from __future__ import annotations

import abc
import dataclasses
import pathlib
import threading
from collections.abc import Callable

from swap_state.common.checksum import crc32
from swap_state.common.snapshot_errors import SnapshotCorruptError, SnapshotError
from swap_state.common.snapshot_format import FileRecord, SnapshotIndex, rank_data_name, rank_manifest_name
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter
from swap_state.server.snapshot.writing.sink import ChunkSink

__all__ = ["COPY_BLOCK_BYTES", "CommitResult", "StepPlan", "StepWrite", "TierWriter", "copy_rank"]

COPY_BLOCK_BYTES = 8 << 20  # a copied file is read, checksummed and handed to the tier in such blocks


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One host's part of one step, as the writer asks a tier for it."""

    job_id: str
    step: int
    world_size: int  # the job's (global) number of ranks
    ranks: tuple[int, ...]  # the ranks this host writes, ascending, when known at prepare (a live snapshot's: empty)
    tenant: str  # the tenant that owns the job, recorded with the files
    keep: int | None  # the job's complete steps the tier keeps at TierWriter.finish (None: all)
    replace: bool = False  # whether TierWriter.finish replaces a complete step of an earlier attempt (else refuses)
    expected_bytes: int = 0  # the step's bytes on this host, as far as known at prepare (a tier with a budget reserves them)
    source: SnapshotIndex | None = None
    """The files to write when known before (a durable snapshot copied into the tier): a tier
    may find a rank already holding them and skip it; the store needs it (its markers)."""


@dataclasses.dataclass(frozen=True)
class StepWrite:
    """A step being written into one tier: what :meth:`TierWriter.prepare` gave."""

    plan: StepPlan
    location: pathlib.PurePath | str  # where its files go until TierWriter.finish (a partial directory)
    ranks: tuple[int, ...]  # the ranks of the plan to write; a rank the tier holds already is not here


@dataclasses.dataclass(frozen=True)
class CommitResult:
    """What :meth:`TierWriter.finish` did."""

    path: pathlib.PurePath | str  # where the complete step is (a directory; the step's place in the store)
    warnings: tuple[str, ...]  # failures after it was complete (latest pointer, index, retention): not fatal
    trash: tuple[pathlib.PurePath, ...] = ()
    """Unlisted locations whose bytes the directory's ``empty_trash`` removes once the snapshot
    was reported durable (deleting a large snapshot takes long enough to delay it)."""


class TierWriter(abc.ABC):
    """Where a step's files are written, and the tier's one commit rule. Call order::

        target = tier.prepare(plan)                   # an unlisted place for the step's files
        for rank in target.ranks:                     # each rank of this host, in any order
            sink = tier.open_file(target, data_name)  # the data file, streamed (ChunkSink's order)
            tier.write_file(target, manifest_name, raw)     # small files, whole
            tier.finish_rank(target, rank, files)     # the rank's files are there, together
        result = tier.finish(target, index, layout)   # the commit rule: complete from its return
        tier.discard(target)                          # instead of finish, on failure

    A reader never lists a step partly written (each tier's rule says when it appears).
    Thread-safe for different steps; one thread per rank of one step.
    """

    root: object
    """Where the tier is, for messages: a directory, a store's URI."""

    @abc.abstractmethod
    def prepare(self, plan: StepPlan) -> StepWrite:
        """A place for the step's files, not listed; SnapshotExistsError (or SnapshotError) when
        the tier refuses the step."""

    @abc.abstractmethod
    def open_file(self, target: StepWrite, name: str) -> ChunkSink:
        """A new file ``name`` of the step, written in order through the sink; durable (or its
        put complete) once the sink's ``finish`` returned, gone when it is closed before."""

    @abc.abstractmethod
    def write_file(self, target: StepWrite, name: str, data: bytes) -> None:
        """A new small file ``name`` with ``data``, durable on return."""

    @abc.abstractmethod
    def finish_rank(self, target: StepWrite, rank: int, files: tuple[FileRecord, ...]) -> None:
        """The rank's ``files`` (data, manifest) are written: record them as one rank's."""

    @abc.abstractmethod
    def finish(self, target: StepWrite, index: SnapshotIndex, layout: bytes | None) -> CommitResult:
        """Make the step complete (the tier's commit rule), then its retention (``plan.keep``).
        ``index``: this host's ranks and files; ``layout``: the step's ``layout.json`` when this
        host knows it (every rank here). Raises before the step is complete, warns after."""

    @abc.abstractmethod
    def discard(self, target: StepWrite) -> bool:
        """Remove what was written of a step that will not finish, best effort; True when gone."""


def copy_rank(source: SnapshotTier, info: SnapshotInfo, rank: int, tier: TierWriter, target: StepWrite,
              limiter: BandwidthLimiter, cancel: threading.Event, progress: Callable[[int], None]) -> int:
    """Write one rank's files of a complete snapshot of ``source`` through ``tier``: the data file in blocks
    (bounded memory), each piece final (``advance``) only once the bytes so far can still match its size and crc32
    in ``snapshot.json`` (a file that changed since its snapshot never completes), then the manifest, checked, then
    :meth:`TierWriter.finish_rank`. ``progress(bytes)``: the data file's bytes handed over so far. Returns the
    rank's bytes."""
    data, manifest = info.file(rank_data_name(rank)), info.file(rank_manifest_name(rank))
    value = size = 0
    with tier.open_file(target, data.name) as sink:
        for block in source.read_blocks(info, data.name, COPY_BLOCK_BYTES):
            if not limiter.acquire(len(block), cancel):
                raise SnapshotError("the server is shutting down: the copy was abandoned")
            with memoryview(block) as view:
                for placed in sink.put_pieces(view):
                    value, size = crc32(placed, value), size + placed.nbytes
                    if size > data.bytes or (size == data.bytes and value != data.crc32):
                        _check(info, data, size, value)
            progress(size)
        _check(info, data, size, value)
        sink.finish()
    tier.write_file(target, manifest.name, source.read_listed(info, manifest))
    tier.finish_rank(target, rank, (data, manifest))
    return data.bytes + manifest.bytes


def _check(info: SnapshotInfo, record: FileRecord, size: int, value: int) -> None:
    if size != record.bytes or value != record.crc32:
        raise SnapshotCorruptError(f"{info.path / record.name} no longer matches its checksum in snapshot.json: "
                                   "not copied")
