"""Snapshots of committed steps, taken without pausing the trainer: the coordinator.

Call order (the servicer):

1. ``SnapshotCoordinator(snapshot_dir, settings, copy_policy=P)`` once
   at server start (it removes what a killed writer left; ``note_epoch`` of adopted segments).
2. Snapshot RPC: ``handle = coordinator.start(SnapshotSource(...))`` validates and publishes
   the snapshot epoch: on return the snapshot is *consistent*, the trainer may go on. A thread
   persists the rank (:mod:`.writing.writer`), a stager copies ahead of the trainer (:mod:`.writing.copy_ahead`).
3. SnapshotStatus RPC: ``await coordinator.wait_status(snapshot_id, rank, wait_s)``:
   ``durable`` once this server's ``local_world_size`` ranks are on disk and committed,
   ``failed`` otherwise; ``stored`` once uploaded to the store, if any. ``in_progress()``: Stats.
4. Before unmapping a segment: ``handle.cancel(reason)``, ``handle.segment_released.wait()``.
5. Server shutdown: ``coordinator.close()``.

The ranks of a (job, step) on this server form a group that commits or fails together (:mod:`.group`); a multi-host
job's server commits its own ranks'. Thread-safe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from swap_state.common.segment import Word
from swap_state.common.server_config import SnapshotSettings
from swap_state.common.errors import BudgetExhaustedError, ReplicaPeersUnsetError
from swap_state.common.sizes import format_size
from swap_state.common.snapshot_errors import (
    SnapshotBusyError, SnapshotError, SnapshotFailedError, SnapshotInvalid, SnapshotNotFoundError,
    StoreUnavailableError, from_os_error)
from swap_state.common.checksum import crc32
from swap_state.common.snapshot_format import LAYOUT_NAME, FileRecord, SnapshotIndex
from swap_state.common.snapshot_metadata import MAX_METADATA_BYTES
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier
from swap_state.common.addresses import parse_peers
from swap_state.common.names import parse_snapshot_id, shorten
from swap_state.common.object_store import open_store
from swap_state.common.stored_snapshots import StoredSnapshots

from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.logs import log_event
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter
from swap_state.server.snapshot.group import RankRun, RankSnapshot, SnapshotGroup
from swap_state.server.snapshot.restoring.host_snapshots import HostSnapshots
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex
from swap_state.server.snapshot.restoring.peer_snapshots import PeerSnapshots
from swap_state.server.snapshot.writing.source import SnapshotSource, check_source
from swap_state.server.snapshot.status import SnapshotState, SnapshotStatus
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.seam import StepPlan, TierWriter
from swap_state.server.snapshot.tiers.replica import ReplicaTier
from swap_state.server.snapshot.tiers.replica_wire import peer_credentials
from swap_state.server.snapshot.tiers.mirror import MirroredTier
from swap_state.server.snapshot.tiers.replicate import ReplicaStates
from swap_state.server.snapshot.tiers.store import StoreTier
from swap_state.server.snapshot.tiers.upload import SnapshotUploader
from swap_state.server.snapshot.writing.writer import Cancelled, RankWriter

log = logging.getLogger(__name__)

__all__ = ["SnapshotSource", "SnapshotState", "SnapshotStatus", "RankSnapshot", "SnapshotCoordinator"]

MEMORY_KEEP = 1  # a job's memory-only snapshots kept here: the newest (and, while one is written, the one before it)
HISTORY = 64  # finished snapshots whose status stays in memory (older ones are answered from disk)
ASSEMBLY_CHECK_S = 1.0  # how often a group waiting for ranks looks for one that moved past its step or restarted
DISCARD_WAIT_S = 10.0  # how long a restarted rank's start waits for the old attempt's files to go


class SnapshotCoordinator:
    """Starts, tracks and commits snapshots under one snapshot directory."""

    def __init__(self, snapshot_dir: str | os.PathLike[str], settings: SnapshotSettings = SnapshotSettings(), *,
                 assemble_timeout_s: float = 300.0, max_metadata_bytes: int = MAX_METADATA_BYTES,
                 clean_stale: bool = True, copy_policy: CopyBudgetPolicy | None = None,
                 job_ranks: Callable[[str], dict[int, RankRun]] = lambda job_id: {},
                 replicas: SnapshotReader | None = None, memory: SnapshotDirectory | None = None):
        """``settings``: retention, writers, store (the server's flags).
        ``assemble_timeout_s``: fail when not all ``local_world_size`` ranks started by then.
        ``clean_stale``: remove a previous run's partial snapshots (False: a live server shares it).
        ``copy_policy``: the memory rule's inputs, shared with the arena, and the cap on all
        snapshot I/O (``--persist-max-bandwidth``).
        ``job_ranks(job)``: each rank of ``job`` attached here (a group waiting for a rank whose
        trainer restarted, or is past its step, fails at once: that rank never joins it). ``replicas``: the
        replicas peers sent this server (``--replica-listen``), restored from beside its own.
        ``memory``: where memory-only snapshots are kept here (with ``--replica-peers``)."""
        keep_latest, stage_threads = settings.keep_latest, settings.stage_threads
        if (keep_latest is not None and keep_latest < 2) or assemble_timeout_s <= 0 or stage_threads < 1:
            raise ValueError(f"keep_latest must be >= 2 or None (keep all), assemble_timeout_s > 0 and "
                             f"stage_threads >= 1: got {keep_latest}, {assemble_timeout_s}, {stage_threads}")
        self.settings = settings
        self.stage_threads = stage_threads
        self.copy_policy = copy_policy or CopyBudgetPolicy()  # this coordinator records each snapshot's rate
        self.directory = SnapshotDirectory(snapshot_dir, settings.direct_io)  # where snapshots are written
        self.local = self.directory.reader  # the local tier: what they are read from
        self.keep_latest = keep_latest
        self.assemble_timeout_s = assemble_timeout_s
        self.max_metadata_bytes = max_metadata_bytes
        self._limiter = BandwidthLimiter(self.copy_policy.max_bandwidth)
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, int], SnapshotGroup] = {}
        self._holding: dict[tuple[str, int], RankSnapshot] = {}  # (job, rank) -> reads a segment
        self._last_epoch = 0
        self._closed = False
        directory = self.directory
        try:
            directory.create_root()
        except OSError as exc:
            raise SnapshotError(f"cannot create snapshot directory {directory.root}: {exc}") from None
        try:
            alone = directory.hold()
        except OSError as exc:
            raise SnapshotError(f"cannot lock snapshot directory {directory.root}: {exc}") from None
        if clean_stale and alone:
            directory.clean_stale()
        elif clean_stale:
            log_event(log, "snapshot_dir_shared", logging.INFO, snapshot_dir=str(directory.root),
                      note="another live server uses this directory: its partial snapshots are left alone")
        self.uploader = None
        if settings.store_uri:
            stored = StoredSnapshots(open_store(settings.store_uri, settings.store_timeout_s))
            self.uploader = SnapshotUploader(StoreTier(stored), self.directory, settings.store_max_bandwidth)
        self.stored = self.uploader.stored if self.uploader is not None else None  # the store tier, if any
        self.tier: TierWriter = self.directory  # where snapshots are written: the directory, mirrored to a peer
        self.memory, self.memory_tier = memory, None  # memory-only snapshots: here, mirrored to a peer
        self.replica_states, self._replica_tier, peers = None, None, []
        if settings.replica_peers:
            addresses, credentials = parse_peers(settings.replica_peers), peer_credentials(settings)
            self._replica_tier = ReplicaTier(addresses, credentials, BandwidthLimiter(settings.replica_max_bandwidth))
            self.replica_states = ReplicaStates()
            self.tier = MirroredTier(self.directory, self._replica_tier, self.replica_states)
            if memory is not None:
                self.memory_tier = MirroredTier(memory, self._replica_tier, self.replica_states)
            peers = [PeerSnapshots(address, credentials) for address in addresses]
        mine = [self.local, *([memory.reader] if memory is not None else []), *([replicas] if replicas else [])]
        # What peers may read (never their own answers again), and what restores read from.
        self.held: SnapshotTier = HostSnapshots(mine) if len(mine) > 1 else self.local
        self.host: SnapshotTier = HostSnapshots([*mine, *peers]) if len(mine) + len(peers) > 1 else self.local
        self.job_ranks = job_ranks
        self._store_owners: dict[str, str] = {}  # job id -> tenant, as the store says

    def note_epoch(self, epoch: int) -> None:
        """An epoch a dead server opened in an adopted segment: later ones number above it."""
        self._last_epoch = max(self._last_epoch, epoch)  # at start, before any snapshot

    def start(self, source: SnapshotSource, *, hold: bool = False) -> RankSnapshot:
        """Begin (or join) the snapshot of ``source.step`` for ``source.job_id``; returns once it
        is consistent. Idempotent for a rank's retry. ``hold``: the writer waits for
        ``handle.proceed()`` (at most ``writer.HOLD_MAX_S``), so the reply gets out first.
        Raises SnapshotInvalid, SnapshotBusyError, SnapshotExistsError; SnapshotAlreadyFailed when the
        group failed before this rank came (its status says so: :meth:`wait_status`)."""
        check_source(source)
        with self._lock:
            stale = self._groups.get((source.job_id, source.step))
        if stale is not None and stale.outlived_by(source):
            stale.fail(stale.restarted_error(source.rank))  # outside the lock: removing its files may reach a peer
            with stale.cond:  # its writers see the cancel at once
                stale.cond.wait_for(lambda: stale.discarded_done, DISCARD_WAIT_S)
        with self._lock:
            if self._closed:
                raise SnapshotBusyError("the snapshot coordinator is shut down")
            group = self._group_for(source)
            if isinstance(group, RankSnapshot):
                return group  # a retry of this rank's Snapshot call
            handle = self._join(group, source, hold)
        # After the publish: the trainer's stall is not for this.
        if (short := self.copy_policy.shortfall(source.layout)) is not None:
            log_event(log, "copy_budget_short", logging.WARNING, job_id=source.job_id, rank=source.rank,
                      step=source.step, **short)
        return handle

    def _group_for(self, source: SnapshotSource) -> SnapshotGroup | RankSnapshot:
        """Under self._lock: the handle of a retry, or the group ``source`` joins (maybe new)."""
        key = (source.job_id, source.step)
        group = self._groups.get(key)
        if group is not None:
            group = group.decide_start(source)
            if isinstance(group, RankSnapshot):
                return group
            if group is None:
                del self._groups[key]  # a fresh attempt at the step
        if (holder := self._holding.get((source.job_id, source.rank))) is not None:
            raise SnapshotBusyError(f"rank {source.rank} of job {source.job_id} is still persisting "
                               f"{holder.snapshot_id}")
        if source.header[Word.SNAP_EPOCH] != 0:
            raise SnapshotBusyError("the segment is being snapshotted (SNAP_EPOCH is set)")
        if writing := source.header[Word.WRITING_STEP]:
            raise SnapshotBusyError(f"the trainer is writing step {writing - 1}; snapshot between steps, "
                               "after CommitStep")
        return group if group is not None else self._new_group(source)

    def job_owner(self, job_id: str) -> str | None:
        """The tenant that owns ``job_id``'s snapshots: its newest one's here, else in the store
        (remembered: an owner does not change); None when neither has one or it is unreachable."""
        if snapshots := self.local.list(job_id):
            return snapshots[-1].index.tenant
        if self.stored is None:
            return None
        if job_id not in self._store_owners:
            try:
                steps = self.stored.steps(job_id)
                newest = next((info for step in reversed(steps)
                               if (info := self.stored.step_info(job_id, step)) is not None), None)
            except StoreUnavailableError:
                return None  # a restore still checks the snapshot it reads
            if newest is None:
                return None
            self._store_owners[job_id] = newest.index.tenant
        return self._store_owners[job_id]

    def _new_group(self, source: SnapshotSource) -> SnapshotGroup:
        """Refused past ``--tenant-snapshot-quota`` (the tenant's snapshots here and this one,
        estimated from this rank's bytes); whose job it is the caller decided."""
        quota = 0 if source.memory_only else self.settings.tenant_snapshot_quota
        mine = [i.bytes for i in self.local.list() if i.index.tenant == source.tenant] if quota else []
        held, new = sum(mine), sum(t.nbytes for t in source.layout.tensors) * source.expected_ranks
        if quota and held + new > quota:
            raise BudgetExhaustedError(
                f"snapshot {source.job_id}/step-{source.step} refused: about {format_size(new)} more "
                f"would take this tenant's snapshots in {self.directory.root} from {format_size(held)} "
                f"past its --tenant-snapshot-quota {format_size(quota)}; lower "
                "the job's retention (keep_latest), remove old jobs, or ask for a larger quota")
        tier, keep = self.tier, self._retention_for(source)
        if source.memory_only:
            if self.memory_tier is None:
                raise ReplicaPeersUnsetError(f"snapshot {source.job_id}/step-{source.step} asks for memory only: "
                                             "this server has no --replica-peers to send it to")
            tier, keep = self.memory_tier, MEMORY_KEEP
        plan = StepPlan(source.job_id, source.step, source.world_size, (), source.tenant, keep,
                        replace=source.replace_existing or source.memory_only, expected_bytes=new)
        group = SnapshotGroup(tier, tier.prepare(plan), source)
        self._groups[(source.job_id, source.step)] = group
        finished = sorted((g.finished_monotonic, key) for key, g in self._groups.items()
                          if g.finished_monotonic is not None
                          and (g.state is SnapshotState.DURABLE or g.discarded_done))
        for _, key in finished[: max(0, len(finished) - HISTORY)]:
            del self._groups[key]
        if group.local_world_size > 1:  # the runs of the ranks it waits for, as they are now
            group.note_runs(self._ranks_here(source.job_id, (group.world_size, group.local_world_size)) or {})
            self._watch_assembly(group, time.monotonic() + self.assemble_timeout_s)
        return group

    def _join(self, group: SnapshotGroup, source: SnapshotSource, hold: bool) -> RankSnapshot:
        """Under self._lock: this rank's writer, handle and thread; publish, then start the thread."""
        # The epoch increases per segment even across coordinators: above every COW_EPOCH in the
        # header and the epoch a trainer gave up (protocol step 6).
        header = source.header
        self._last_epoch = max(self._last_epoch, header.highest_cow_epoch(), header[Word.ABANDONED_EPOCH]) + 1
        writer = RankWriter(source, self._last_epoch, tier=group.tier, target=group.target,
                            limiter=self._limiter, cancel=group.cancel, started_monotonic=time.monotonic(),
                            settings=self.settings)
        if not hold:
            writer.go()
        handle = RankSnapshot(group, source.rank, writer)
        handle.thread = threading.Thread(target=self._run, args=(group, handle), daemon=True,
                                         name=f"snapshot-{source.job_id}-{source.step}-r{source.rank}")
        group.add_handle(handle)
        self._holding[(source.job_id, source.rank)] = handle
        writer.publish()  # consistent from here on
        try:
            handle.thread.start()
        except RuntimeError as exc:  # no thread: the trainer must not wait on this epoch
            writer.release_segment()
            del self._holding[(source.job_id, source.rank)]
            group.thread_done()
            error = SnapshotError(f"cannot start a snapshot writer thread: {exc}")
            group.fail(error, source.rank)
            raise error from None
        return handle

    def _retention_for(self, source: SnapshotSource) -> int | None:
        """Snapshots of the job kept at commit (None: all): the job's own retention where it asks
        for more than ``keep_latest``, except a tenant that is not an admin (the operator's disk)."""
        if self.keep_latest is None:
            return None
        if source.bounded_retention:
            if source.keep_all or source.keep_latest > self.keep_latest:
                log_event(log, "retention_bounded", logging.INFO, job_id=source.job_id, tenant=source.tenant,
                          asked="all" if source.keep_all else source.keep_latest, kept=self.keep_latest,
                          detail="a tenant keeps at most the server's --keep-latest")
            return self.keep_latest
        return None if source.keep_all else max(self.keep_latest, source.keep_latest)

    def _watch_assembly(self, group: SnapshotGroup, deadline: float) -> None:
        """Until every rank of ``group`` joined: fail it at ``deadline``, or as soon as a missing
        rank is seen past its step or restarted (checked every :data:`ASSEMBLY_CHECK_S`)."""
        group.timer = threading.Timer(max(0.0, min(ASSEMBLY_CHECK_S, deadline - time.monotonic())),
                                      self._check_assembly, (group, deadline))
        group.timer.daemon = True
        group.timer.start()

    def _ranks_here(self, job_id: str, shape: tuple[int, int]) -> dict[int, RankRun] | None:
        """The ranks of ``job_id`` here in a job of ``shape`` (world size, ranks here); None: one freed mid-read."""
        try:
            return {rank: now for rank, now in self.job_ranks(job_id).items() if now.shape == shape}
        except (AttributeError, TypeError, ValueError):  # its header unmapped while read, off the loop
            return None

    def _check_assembly(self, group: SnapshotGroup, deadline: float) -> None:
        with group.cond:
            if len(group.handles) == group.local_world_size or group.state is not SnapshotState.PERSISTING:
                return
            joined = sorted(group.handles)
        ranks = self._ranks_here(group.job_id, (group.world_size, group.local_world_size))
        if ranks is not None and (error := group.missing_for_good(ranks)) is not None:
            group.fail(error)
            return
        if time.monotonic() < deadline:
            self._watch_assembly(group, deadline)
            return
        expected = f"world_size {group.world_size}"
        if group.local_world_size != group.world_size:
            expected = f"the {group.local_world_size} ranks expected on this server (local_world_size; {expected})"
        group.fail(SnapshotFailedError(f"only ranks {joined} of {expected} started {group.snapshot_id} "
                                  f"within {self.assemble_timeout_s:g} s"))

    def _run(self, group: SnapshotGroup, handle: RankSnapshot) -> None:
        """A rank's thread: persist, then fail the group, or commit it when last."""
        result = error = None
        try:
            try:
                result = handle.writer.run()
            except Cancelled:
                pass  # the group already failed for a reason of its own
            except SnapshotError as exc:
                error = exc
            except Exception as exc:  # a bug must fail the snapshot, not hang its waiters
                error = SnapshotError(f"unexpected error persisting rank {handle.rank}: {exc!r}")
            with self._lock:
                if self._holding.get((group.job_id, handle.rank)) is handle:
                    del self._holding[(group.job_id, handle.rank)]
            if result is not None:
                self.copy_policy.record(handle.writer.persist_rate())
            if error is not None:
                group.fail(error, handle.rank)
            if result is not None and group.add_result(handle.rank, result):
                self._commit(group)
        finally:
            group.thread_done()

    def _commit(self, group: SnapshotGroup) -> None:
        """In the thread of the last rank to finish: layout index, index, rename, latest, retention."""
        with group.cond:
            results = dict(group.results)
        ranks = tuple(sorted(results))
        files = [file for rank in ranks for file in results[rank].files]
        try:
            attempt = 1  # or one more than the snapshot of the step this commit replaces
            if group.replace:
                with contextlib.suppress(SnapshotError):
                    attempt = self.local.resolve(group.snapshot_id).index.attempt + 1
            layout = None  # one host's part of a multi-host step gets its layout index in the store
            if len(results) == group.world_size:
                layout = LayoutIndex({r: result.manifest.tensors for r, result in results.items()},
                                     group.world_size).to_bytes()
            index = SnapshotIndex(
                job_id=group.job_id, step=group.step, world_size=group.world_size, ranks=ranks, files=tuple(files),
                created_unix=time.time(), attempt=attempt, tenant=group.tenant,
                layout=None if layout is None else FileRecord(LAYOUT_NAME, -1, len(layout), crc32(layout)))
            commit = group.tier.finish(group.target, index, layout)
        except SnapshotError as exc:
            group.fail(exc)
            return
        except OSError as exc:
            group.fail(from_os_error(exc, f"committing {group.snapshot_id}", self.directory.root))
            return
        except Exception as exc:  # a bug must fail the snapshot, not hang its waiters
            group.fail(SnapshotError(f"unexpected error committing {group.snapshot_id}: {exc!r}"))
            return
        if self.uploader is not None and not group.memory_only:  # before the waiters wake: their status says uploading
            self.uploader.submit(SnapshotInfo.of(index, commit.path, latest=True), group.keep)
        with group.cond:
            group.commit = commit
            group.state = SnapshotState.DURABLE
            group.finished_monotonic = time.monotonic()
            group.cond.notify_all()
        directory = self.memory if group.memory_only and self.memory is not None else self.directory
        for warning in directory.empty_trash(commit):  # off the durability path
            log_event(log, "snapshot_retention_failed", logging.WARNING, snapshot_id=group.snapshot_id, error=warning)

    def _group(self, snapshot_id: str) -> SnapshotGroup | None:
        """The in-memory group of a snapshot (``<job>/step-<N>``, never ``latest``), if any."""
        ref = parse_snapshot_id(snapshot_id, None, SnapshotInvalid)
        if ref.step is None:  # a status is about one snapshot, never ``latest``
            raise SnapshotInvalid(f"snapshot id {shorten(snapshot_id)} is not '<job>/step-<N>'")
        with self._lock:
            return self._groups.get((ref.job_id, ref.step))

    def handle(self, snapshot_id: str, rank: int) -> RankSnapshot | None:
        """The in-memory handle of a rank's snapshot, if any."""
        group = self._group(snapshot_id)
        if group is None:
            return None
        with group.cond:
            return group.handles.get(rank)

    async def wait_status(self, snapshot_id: str, rank: int, wait_s: float = 0.0,
                          wait_stored: bool = False, wait_replicated: bool = False) -> SnapshotStatus:
        """A rank's status (one not in memory from disk, else the store, else SnapshotNotFoundError)
        after waiting up to ``wait_s`` for a terminal state (``wait_stored``: for stored); awaits
        without holding a thread, save for reads from disk or the store."""
        deadline = time.monotonic() + wait_s
        handle, group = self.handle(snapshot_id, rank), self._group(snapshot_id)
        if handle is not None:
            status = await handle.wait_async(wait_s) if wait_s > 0 else handle.status()
        elif group is not None and (missed := group.missed_status(rank)) is not None:
            return missed  # the group failed before this rank came (or it never came)
        else:
            status = await asyncio.to_thread(self._status_at_rest, snapshot_id, rank)
        if status.state is not SnapshotState.DURABLE:
            return status
        if self.replica_states is not None:
            if wait_replicated:
                await self.replica_states.wait_async(status.job_id, status.step, max(0.0, deadline - time.monotonic()))
            status = self.replica_states.annotate(status)
        if self.uploader is None:
            return status
        if wait_stored:
            await self.uploader.wait_async(status.job_id, status.step, status.rank,
                                           max(0.0, deadline - time.monotonic()))
        return await asyncio.to_thread(self.uploader.annotate, status)

    def _status_at_rest(self, snapshot_id: str, rank: int) -> SnapshotStatus:
        try:
            info = self.local.resolve(snapshot_id)
        except SnapshotNotFoundError:
            if self.uploader is None:
                raise
            return self.uploader.stored_status(snapshot_id, rank)  # only in the store
        return SnapshotStatus.from_disk(info, self.local.read_manifest(info, rank))

    def in_progress(self) -> list[SnapshotStatus]:
        """Statuses of every rank of every snapshot still persisting (for Stats)."""
        with self._lock:
            groups = list(self._groups.values())
        statuses = []
        for group in groups:
            with group.cond:
                handles = list(group.handles.values()) if group.state is SnapshotState.PERSISTING else []
            statuses.extend(h.status() for h in handles)
        return statuses

    def close(self, timeout: float | None = 10.0) -> None:
        """Fail every running snapshot, wait for the writer threads, refuse new snapshots."""
        with self._lock:
            self._closed = True
            groups = list(self._groups.values())
        threads = []
        for group in groups:
            group.fail(SnapshotFailedError("the server is shutting down"))
            with group.cond:
                threads.extend(h.thread for h in group.handles.values() if h.thread is not None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.uploader is not None:
            self.uploader.close()
        if self._replica_tier is not None:
            self._replica_tier.close()
        self.directory.release()
