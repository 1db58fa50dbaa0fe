"""One snapshot's state as the coordinator tracks it: the group of ranks of a (job, step) on
this server, each rank's :class:`RankSnapshot`, and the :class:`SnapshotStatus` they report.

A group commits together or fails together: a failed rank cancels the others, and their
partial files are removed. Handles are what the servicer holds: ``status()``, ``wait()``,
``wait_segment_released()``, ``proceed()`` (let a held writer stream), ``cancel()``.
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import threading
import time

from swap_state.common.names import snapshot_id_for
from swap_state.common.snapshot_errors import SnapshotError, SnapshotFailed
from swap_state.common.snapshot_format import RankManifest
from swap_state.common.snapshot_reader import SnapshotInfo

from swap_state.server.snapshot.store import CommitResult, SnapshotStore
from swap_state.server.snapshot.writer import RankResult, RankWriter

__all__ = ["SnapshotState", "SnapshotStatus", "SnapshotGroup", "RankSnapshot"]


class SnapshotState(str, enum.Enum):
    """The protocol's state strings (``SnapshotStatusReply.state``)."""

    PERSISTING = "persisting"
    DURABLE = "durable"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class SnapshotStatus:
    """One rank's view of a snapshot; field for field a SnapshotStatusReply, plus a few."""

    snapshot_id: str
    """``<job_id>/step-<step>``."""
    job_id: str
    """The job."""
    step: int
    """The committed step."""
    rank: int
    """The rank this status is about."""
    world_size: int
    """The job's (global) world size."""
    state: SnapshotState
    """persisting until the whole snapshot is committed, then durable; or failed."""
    bytes_total: int
    """Tensor bytes of this rank."""
    bytes_persisted: int
    """Tensor bytes of this rank written so far."""
    error: str
    """Why it failed (empty unless failed); names the directory for disk-full errors."""
    cow_copies: int
    """Chunks the trainer copied before writing, during this snapshot (this rank)."""
    backpressure_waits: int
    """Times the trainer waited for a free copy slot, during this snapshot (this rank)."""
    backpressure_wait_seconds: float
    """Seconds the trainer spent in those waits."""
    path: str
    """The snapshot directory (the partial one until durable)."""
    ranks_joined: int
    """Ranks that have started this snapshot."""
    ranks_persisted: int
    """Ranks whose files are written and fsynced."""
    segment_released: bool
    """Whether the server is done reading this rank's segment."""
    warnings: tuple[str, ...] = ()
    """Problems after the commit (latest pointer, retention) that did not fail the snapshot."""
    local_world_size: int = 0
    """Ranks that must be durable on this server before the snapshot is (0: ``world_size``)."""
    ranks: tuple[int, ...] = ()
    """The ranks that have joined (in memory) or that the durable snapshot holds (from disk)."""

    @classmethod
    def from_disk(cls, info: SnapshotInfo, manifest: RankManifest) -> "SnapshotStatus":
        """A durable snapshot no longer in memory, as its index and the rank's manifest say."""
        total = sum(t.nbytes for t in manifest.tensors)
        return cls(
            snapshot_id=info.snapshot_id,
            job_id=info.job_id,
            step=info.step,
            rank=manifest.rank,
            world_size=info.world_size,
            state=SnapshotState.DURABLE,
            bytes_total=total,
            bytes_persisted=total,
            error="",
            cow_copies=manifest.cow_copies,
            backpressure_waits=manifest.backpressure_waits,
            backpressure_wait_seconds=manifest.backpressure_wait_seconds,
            path=str(info.path),
            ranks_joined=info.local_world_size,
            ranks_persisted=info.local_world_size,
            segment_released=True,
            local_world_size=info.local_world_size,
            ranks=info.ranks,
        )
    server_staged_chunks: int = 0
    """Chunks the server's stager copied ahead of the trainer (this rank; 0 from disk)."""
    server_staged_bytes: int = 0
    """Bytes of those chunks."""
    trainer_copied_bytes: int = 0
    """Bytes of the chunks the trainer copied itself (``cow_copies`` of them; 0 from disk)."""


class SnapshotGroup:
    """The ranks of one (job, step). Its condition guards every field below."""

    def __init__(
        self,
        store: SnapshotStore,
        job_id: str,
        step: int,
        world_size: int,
        local_world_size: int,
        partial: pathlib.Path,
        keep: int | None,
    ):
        self.store = store
        self.keep = keep
        """Retention applied at commit: the job's wish, never below the server's floor."""
        self.job_id = job_id
        self.step = step
        self.world_size = world_size
        self.local_world_size = local_world_size
        """Distinct ranks that complete the group (this server's share of ``world_size``)."""
        self.partial = partial
        self.snapshot_id = snapshot_id_for(job_id, step)
        self.cond = threading.Condition()
        self.cancel = threading.Event()
        self.handles: dict[int, RankSnapshot] = {}
        self.results: dict[int, RankResult] = {}
        self.rank_errors: dict[int, SnapshotError] = {}
        self.state = SnapshotState.PERSISTING
        self.error: SnapshotError | None = None
        self.commit: CommitResult | None = None
        self.live_threads = 0
        self.discarded = False  # failed, and one thread has claimed removing its files
        self.discarded_done = False  # ... and they are gone
        self.replace = False
        """At commit, replace a durable snapshot of the same step (an earlier attempt's)."""
        self.timer: threading.Timer | None = None
        self.finished_monotonic: float | None = None

    def fail(self, error: SnapshotError, rank: int | None = None) -> None:
        """First failure wins; cancels the other ranks; removes files once no thread writes."""
        with self.cond:
            if rank is not None:
                self.rank_errors.setdefault(rank, error)
            if self.state is not SnapshotState.PERSISTING:
                return
            self.state = SnapshotState.FAILED
            prefix = f"rank {rank}: " if rank is not None and self.local_world_size > 1 else ""
            self.error = type(error)(prefix + str(error))
            self.finished_monotonic = time.monotonic()
            self.cancel.set()
            for handle in self.handles.values():
                handle.proceed()  # a held writer sees the cancel now, not after HOLD_MAX_S
            if self.timer is not None:
                self.timer.cancel()
            self.cond.notify_all()
        self.discard_if_idle()

    def discard_if_idle(self) -> None:
        with self.cond:
            if self.state is not SnapshotState.FAILED or self.live_threads or self.discarded:
                return
            self.discarded = True  # claimed: exactly one caller removes the directory
        self.store.discard(self.partial)
        with self.cond:
            self.discarded_done = True
            self.cond.notify_all()


class RankSnapshot:
    """One rank's snapshot. Thread-safe; obtained from :meth:`SnapshotCoordinator.start`."""

    def __init__(self, group: SnapshotGroup, rank: int, writer: RankWriter):
        self._group = group
        self._writer = writer
        self.rank = rank
        self.thread: threading.Thread | None = None
        self.commits_at_start = 0
        """The segment's TRAINER_COMMITS when the snapshot began: a later Snapshot call of the
        same step with the same count is a retry, with another a retrained step."""

    @property
    def snapshot_id(self) -> str:
        return self._group.snapshot_id

    @property
    def job_id(self) -> str:
        return self._group.job_id

    @property
    def step(self) -> int:
        return self._group.step

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def local_world_size(self) -> int:
        return self._group.local_world_size

    @property
    def epoch(self) -> int:
        """The SNAP_EPOCH this rank's snapshot published."""
        return self._writer.epoch

    @property
    def exception(self) -> SnapshotError | None:
        """The error to report (its class names the gRPC code), None unless failed."""
        group = self._group
        with group.cond:
            if group.state is not SnapshotState.FAILED:
                return None
            return group.rank_errors.get(self.rank) or group.error

    def status(self) -> SnapshotStatus:
        group = self._group
        writer = self._writer
        cow_copies, bp_waits, bp_wait_ns = writer.counters()
        staged_chunks, staged_bytes, trainer_bytes = writer.server_counters()
        with group.cond:
            state = group.state
            error = ""
            if state is SnapshotState.FAILED:
                error = str(group.rank_errors.get(self.rank) or group.error)
            durable = state is SnapshotState.DURABLE and group.commit is not None
            return SnapshotStatus(
                snapshot_id=group.snapshot_id,
                job_id=group.job_id,
                step=group.step,
                rank=self.rank,
                world_size=group.world_size,
                state=state,
                bytes_total=writer.bytes_total,
                bytes_persisted=writer.bytes_persisted,
                error=error,
                cow_copies=cow_copies,
                backpressure_waits=bp_waits,
                backpressure_wait_seconds=bp_wait_ns / 1e9,
                path=str(group.commit.path if durable else group.partial),
                ranks_joined=len(group.handles),
                ranks_persisted=len(group.results),
                segment_released=writer.segment_released.is_set(),
                warnings=group.commit.warnings if durable else (),
                local_world_size=group.local_world_size,
                ranks=tuple(sorted(group.handles)),
                server_staged_chunks=staged_chunks,
                server_staged_bytes=staged_bytes,
                trainer_copied_bytes=trainer_bytes,
            )

    def wait(self, timeout: float | None = None) -> SnapshotStatus:
        """Block until durable, or failed *and* cleaned up (no partial files, no segment
        held), or ``timeout`` seconds; the status either way."""
        group = self._group

        def settled() -> bool:
            return group.state is SnapshotState.DURABLE or (
                group.state is SnapshotState.FAILED and group.discarded_done
            )

        with group.cond:
            group.cond.wait_for(settled, timeout)
        return self.status()

    def wait_segment_released(self, timeout: float | None = None) -> bool:
        """True once the server no longer reads this rank's segment (safe to unmap)."""
        return self._writer.segment_released.wait(timeout)

    def proceed(self) -> None:
        """Let a writer started with ``hold=True`` stream (idempotent; see RankWriter.go)."""
        self._writer.go()

    def cancel(self, reason: str) -> None:
        """Fail the whole snapshot (all ranks); a no-op once it is durable."""
        self._group.fail(SnapshotFailed(f"cancelled: {reason}"), self.rank)
