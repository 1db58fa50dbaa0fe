"""One snapshot as the coordinator tracks it: the group of ranks of a (job, step) on this server
(:class:`SnapshotGroup`), which commits or fails together (a failed rank cancels the others, their partial files go),
and each rank's :class:`RankSnapshot`, the handle the servicer holds (``status()``, ``wait()``, ``segment_released``,
``proceed()``, ``cancel()``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from swap_state.common.names import snapshot_id_for
from swap_state.common.segment import Word
from swap_state.common.snapshot_errors import (
    SnapshotBusyError, SnapshotError, SnapshotExistsError, SnapshotFailedError, SnapshotInvalid)

from swap_state.server.logs import log_event
from swap_state.server.snapshot.writing.source import SnapshotSource
from swap_state.server.snapshot.status import SnapshotState, SnapshotStatus
from swap_state.server.snapshot.tiers.seam import CommitResult, StepWrite, TierWriter
from swap_state.server.snapshot.waiting import WatchedCondition
from swap_state.server.snapshot.writing.writer import RankResult, RankWriter

__all__ = ["RankRun", "SnapshotAlreadyFailed", "SnapshotGroup", "RankSnapshot"]

log = logging.getLogger(__name__)


class SnapshotAlreadyFailed(SnapshotFailedError):
    """A rank asked for a snapshot its group had already failed without it: not refused (the
    servicer answers with the snapshot's id), its status says failed, as every rank's does."""


class RankRun(NamedTuple):
    """A rank of a job attached to this server, as its session registry says."""

    run: tuple[str, int]  # (session id, generation): which trainer; another one means it restarted
    last_committed_step: int | None
    shape: tuple[int, int]  # (world size, ranks of the job on this server): a session of another is another run's


class SnapshotGroup:
    """The ranks of one (job, step). Its condition guards every field below."""

    def __init__(self, tier: TierWriter, target: StepWrite, source: SnapshotSource):
        self.tier, self.target = tier, target  # where the ranks write, and the step's place there
        self.keep = target.plan.keep  # retention applied at commit: the job's wish, never below the server's floor
        self.job_id, self.step, self.world_size = source.job_id, source.step, source.world_size
        self.local_world_size = source.expected_ranks  # the ranks that complete the group here
        self.partial = target.location  # the partial snapshot the ranks write into
        self.snapshot_id = snapshot_id_for(self.job_id, self.step)
        self.tenant = source.tenant  # recorded in snapshot.json
        self.memory_only = source.memory_only  # in this host's memory and a peer's: never uploaded
        self.cond = WatchedCondition()  # threads wait on it, RPCs await it (no thread held)
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
        self.replace = target.plan.replace  # at commit, replace an earlier attempt's durable snapshot
        self.timer: threading.Timer | None = None
        self.runs: dict[int, tuple[str, int]] = {source.rank: source.run}
        """The trainer (run) of each rank of the job here this group waits for: one whose run
        changed restarted (a new Attach), and its retrained step never joins these files."""
        self.finished_monotonic: float | None = None

    def decide_start(self, source: SnapshotSource) -> SnapshotGroup | RankSnapshot | None:
        """What a start of ``source`` for this (job, step) means, under the coordinator's lock:
        the handle of a retry (the same run, nothing committed since), this group to join, or
        None (a new attempt, e.g. replacing a durable step it asks to); else raises."""
        with self.cond:
            state, mine, drained, error = self.state, self.handles.get(source.rank), self.discarded_done, self.error
            members = sorted(self.handles)
            restarted = mine is None and self.runs.setdefault(source.rank, source.run) != source.run
        if mine is not None and mine.is_retry(source) and state is not SnapshotState.FAILED:
            return mine
        if state is SnapshotState.DURABLE:
            if not source.replace_existing:
                raise SnapshotExistsError(
                    f"snapshot {self.snapshot_id} is already durable, from an earlier attempt at that step "
                    "(the trainer retrained it, e.g. after loading an older checkpoint): its bytes are not "
                    "this state's. Use a new job id, or let the snapshot replace it (SnapshotRequest."
                    "replace_existing; torchtitan's glue does, as it overwrites its checkpoint)")
            return None  # a fresh attempt, which replaces the durable one at its commit
        if state is SnapshotState.PERSISTING:
            if mine is not None or self.world_size != source.world_size:
                raise SnapshotBusyError(f"an earlier attempt at {self.snapshot_id} (another run, or before a "
                                   "retrained step) is still persisting")
            if self.local_world_size != source.expected_ranks:
                raise SnapshotInvalid(f"{self.snapshot_id} was started with local_world_size {self.local_world_size} "
                                      f"(ranks of the job on this server), rank {source.rank} attached with "
                                      f"{source.expected_ranks}: all ranks of a job on one server must agree")
            if len(members) >= self.local_world_size:
                raise SnapshotInvalid(f"{self.snapshot_id} already has its local_world_size "
                                      f"{self.local_world_size} ranks {members} on this server; rank "
                                      f"{source.rank} is one more: is local_world_size right for this host?")
            return self
        if mine is None and self.world_size == source.world_size and not restarted:
            # This rank missed the failed attempt: joining a new one alone would only time out.
            raise SnapshotAlreadyFailed(f"{self.snapshot_id} failed: {error}")
        if not drained:
            raise SnapshotBusyError(f"the failed attempt at {self.snapshot_id} is still being cleaned up")
        return None  # a participant retries, or another run starts: a fresh attempt

    def outlived_by(self, source: SnapshotSource) -> bool:
        """Whether ``source`` is a new trainer (run) of a rank this group still waits for: the one it
        waited for never joins, and the new one's retrained step is not these files' (the caller fails
        the group, outside the coordinator's lock)."""
        with self.cond:
            return (self.state is SnapshotState.PERSISTING and source.rank not in self.handles
                    and len(self.handles) < self.local_world_size
                    and self.runs.get(source.rank, source.run) != source.run)

    def note_runs(self, ranks: dict[int, RankRun]) -> None:
        """Record the run of each of the job's ranks attached here (``ranks``) not seen before."""
        with self.cond:
            for rank, now in ranks.items():
                self.runs.setdefault(rank, now.run)

    def missing_for_good(self, ranks: dict[int, RankRun]) -> SnapshotFailedError | None:
        """Why the group cannot complete, given the job's ranks here now (noted first); None if it still may."""
        self.note_runs(ranks)
        with self.cond:
            waited = {rank: run for rank, run in self.runs.items() if rank not in self.handles}
        # A missing rank never asks for the step when its trainer restarted (a new Attach: it retrains) or ended,
        # nor when it committed past the step: its Snapshot went to a server before a restart (or failed there).
        gone = sorted(rank for rank, run in waited.items() if rank not in ranks or ranks[rank].run != run)
        if gone:
            return self.restarted_error(gone[0])
        passed = {rank: now.last_committed_step for rank, now in ranks.items() if rank in waited
                  and now.last_committed_step is not None and now.last_committed_step > self.step}
        if passed:
            rank, step = min(passed.items())
            return SnapshotFailedError(f"rank {rank} of job {self.job_id} committed step {step} without snapshotting "
                                       f"step {self.step} on this server (its request went to a server before a "
                                       f"restart, or failed there): {self.snapshot_id} cannot complete")
        return None

    def restarted_error(self, rank: int) -> SnapshotFailedError:
        """Why the group fails when the trainer of ``rank`` it waited for ended before joining."""
        return SnapshotFailedError(f"rank {rank} of job {self.job_id} restarted (a new trainer attached, or its "
                                   f"session ended) before it snapshotted step {self.step} on this server: "
                                   f"{self.snapshot_id} cannot complete")

    def missed_status(self, rank: int) -> SnapshotStatus | None:
        """A rank that never joined this group: failed with the group's error once it failed, else None."""
        with self.cond:
            if self.state is not SnapshotState.FAILED:
                return None
            return SnapshotStatus(
                snapshot_id=self.snapshot_id, job_id=self.job_id, step=self.step, rank=rank, world_size=self.world_size,
                state=SnapshotState.FAILED, bytes_total=0, bytes_persisted=0, error=str(self.error or ""), cow_copies=0,
                backpressure_waits=0, backpressure_wait_seconds=0.0, path=str(self.partial),
                ranks_joined=len(self.handles), ranks_persisted=len(self.results), segment_released=True,
                local_world_size=self.local_world_size, ranks=tuple(sorted(self.handles)))

    def add_handle(self, handle: RankSnapshot) -> None:
        """A rank joined, its thread about to start; the assembly timer stops once all did."""
        with self.cond:
            self.handles[handle.rank] = handle
            self.live_threads += 1
            if len(self.handles) == self.local_world_size and self.timer is not None:
                self.timer.cancel()

    def add_result(self, rank: int, result: RankResult) -> bool:
        """A rank's files are written; True when it was the last one (the caller commits)."""
        with self.cond:
            if self.state is not SnapshotState.PERSISTING:
                return False
            self.results[rank] = result
            return len(self.results) == self.local_world_size

    def thread_done(self) -> None:
        """A rank's thread ends (or never started): a failed group's files go once none runs."""
        with self.cond:
            self.live_threads -= 1
        self.discard_if_idle()

    def fail(self, error: SnapshotError, rank: int | None = None) -> None:
        """First failure wins; cancels the other ranks; removes files once no thread writes."""
        with self.cond:
            if rank is not None:  # kept without the traceback: its frames hold the writer's buffers
                self.rank_errors.setdefault(rank, type(error)(str(error)))
            if self.state is not SnapshotState.PERSISTING:
                return
            self.state = SnapshotState.FAILED
            prefix = f"rank {rank}: " if rank is not None and self.local_world_size > 1 else ""
            self.error = type(error)(prefix + str(error))
            log_event(log, "snapshot_failed", logging.WARNING, snapshot_id=self.snapshot_id,
                      error=str(self.error), detail="never listed: its partial files are removed")
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
            self.discarded = True  # claimed: exactly one caller removes the partial snapshot
        self.tier.discard(self.target)
        with self.cond:
            self.discarded_done = True
            self.cond.notify_all()


class RankSnapshot:
    """One rank's snapshot. Thread-safe; obtained from :meth:`SnapshotCoordinator.start`."""

    def __init__(self, group: SnapshotGroup, rank: int, writer: RankWriter):
        self._group = group
        self.writer = writer  # the coordinator publishes, runs and releases through it
        self.rank = rank
        self.epoch = writer.epoch  # the SNAP_EPOCH this rank's snapshot published
        self.segment_released = writer.segment_released
        """Set once the server no longer reads this rank's segment (safe to unmap); coroutines
        await it without holding a thread (``wait_async``)."""
        self.thread: threading.Thread | None = None
        self.commits_at_start = writer.source.header[Word.TRAINER_COMMITS]
        """The segment's TRAINER_COMMITS when the snapshot began: a later Snapshot call of the
        same step with the same count is a retry, with another a retrained step."""

    def is_retry(self, source: SnapshotSource) -> bool:
        """Whether ``source`` asks again for this snapshot: the same run, nothing committed since."""
        return source.run == self.writer.source.run and source.header[Word.TRAINER_COMMITS] == self.commits_at_start

    @property
    def snapshot_id(self) -> str:
        return self._group.snapshot_id

    @property
    def exception(self) -> SnapshotError | None:
        """The error to report (its class names the gRPC code), None unless failed."""
        group = self._group
        with group.cond:
            if group.state is not SnapshotState.FAILED:
                return None
            return group.rank_errors.get(self.rank) or group.error

    def status(self) -> SnapshotStatus:
        group, writer = self._group, self.writer
        cow_copies, bp_waits, bp_wait_ns = writer.counters()
        staged_chunks, staged_bytes, trainer_bytes = writer.server_counters()
        with group.cond:
            state, error = group.state, self.exception  # the condition's lock is reentrant
            durable = state is SnapshotState.DURABLE and group.commit is not None
            return SnapshotStatus(
                snapshot_id=group.snapshot_id, job_id=group.job_id, step=group.step, rank=self.rank,
                world_size=group.world_size, state=state, bytes_total=writer.bytes_total,
                bytes_persisted=writer.bytes_persisted, error=str(error or ""), cow_copies=cow_copies,
                backpressure_waits=bp_waits, backpressure_wait_seconds=bp_wait_ns / 1e9,
                path=str(group.commit.path if durable else group.partial), ranks_joined=len(group.handles),
                ranks_persisted=len(group.results), segment_released=writer.segment_released.is_set(),
                warnings=group.commit.warnings if durable else (), local_world_size=group.local_world_size,
                ranks=tuple(sorted(group.handles)), server_staged_chunks=staged_chunks,
                server_staged_bytes=staged_bytes, trainer_copied_bytes=trainer_bytes)

    def _settled(self) -> bool:
        """Durable, or failed *and* cleaned up; under the group's condition."""
        group = self._group
        return group.state is SnapshotState.DURABLE or (group.state is SnapshotState.FAILED and group.discarded_done)

    def wait(self, timeout: float | None = None) -> SnapshotStatus:
        """Block until settled (durable, or failed and cleaned up) or ``timeout``; the status."""
        with self._group.cond:
            self._group.cond.wait_for(self._settled, timeout)
        return self.status()

    async def wait_async(self, timeout: float | None = None) -> SnapshotStatus:
        """:meth:`wait` for event-loop code: holds no thread while it waits."""
        await self._group.cond.until(self._settled, timeout)
        return self.status()

    def proceed(self) -> None:
        """Let a writer started with ``hold=True`` stream (idempotent; see RankWriter.go)."""
        self.writer.go()

    def cancel(self, reason: str) -> None:
        """Fail the whole snapshot (all ranks); a no-op once it is durable."""
        self._group.fail(SnapshotFailedError(f"cancelled: {reason}"), self.rank)
