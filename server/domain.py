"""The server's state and the operations its RPCs need: :class:`StateServer`, owner of the arena, the
sessions, the snapshot coordinator (None without --snapshot-dir) and the tenancy rule. Blocking work runs in
worker threads; waits for a writer or a group are awaited holding no thread (:mod:`.snapshot.waiting`), so
waiting ranks never starve the executor.

Tenancy, decided here only: a job (its sessions and snapshots) belongs to the tenant that made it; a tenant
may claim a job no other tenant holds (:meth:`Tenant.may_claim`) and reach what it or nobody owns, an admin
everything (:meth:`Tenant.may_reach`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

from swap_state.common.errors import (
    FailedPreconditionError, InvalidRequestError, MetadataBaseUnknownError, NoSegmentError, PermissionDeniedError,
    SnapshotsDisabledError)
from swap_state.common.names import parse_snapshot_id, snapshot_id_for
from swap_state.common.segment import TensorSpec
from swap_state.common.snapshot_metadata_parts import MetadataParts, base_id, parse_base, parse_delta
from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.server.logs import log_event
from swap_state.server.memory.arena import Segment
from swap_state.server.memory.session import LivenessStream, Session
from swap_state.server.memory.sessions import SessionRegistry
from swap_state.server.observability.metrics import SnapshotCounters
from swap_state.server.snapshot.tiers.replica_receiver import ReplicaReceiver
from swap_state.server.snapshot.coordinator import RankSnapshot, SnapshotCoordinator
from swap_state.server.snapshot.group import SnapshotAlreadyFailed
from swap_state.server.snapshot.restoring.restore import RestoreResult, restore
from swap_state.server.snapshot.writing.source import SnapshotSource
from swap_state.server.snapshot.status import SnapshotStatus
from swap_state.server.snapshot.restoring.tier_choice import list_both_tiers
from swap_state.server.tenants import Tenant

__all__ = ["MAX_STATUS_WAIT_S", "SnapshotAsk", "StateServer"]

log = logging.getLogger(__name__)

MAX_STATUS_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class SnapshotAsk:
    """What a Snapshot call asks for, besides its session."""

    step: int  # the step to snapshot: the session's last committed one
    metadata_base_id: str = ""  # the digest of the metadata base the delta applies to ("": no metadata)
    metadata_base_json: str = ""  # the base itself, when sent along (else the one kept with the session)
    metadata_delta_json: str = ""  # this step's part of the metadata
    keep_latest: int = 0  # durable snapshots the job asks to keep
    keep_all: bool = False  # the job keeps every snapshot
    replace_existing: bool = False  # a durable snapshot of this step from an earlier attempt is replaced
    memory_only: bool = False  # kept in this host's memory and a peer's, not on disk (``SnapshotRequest.memory_only``)


class StateServer:
    """Every operation of the SwapState service on the server's state, for a caller's tenant."""

    def __init__(self, registry: SessionRegistry, snapshots: SnapshotCoordinator | None,
                 replica_receiver: ReplicaReceiver | None = None) -> None:
        self.registry = registry
        self.arena = registry.arena
        self.snapshots = snapshots
        self.snapshot_counters = SnapshotCounters()
        self.replica_receiver = replica_receiver  # --replica-listen's, for the metrics
        self._finishing: set[asyncio.Task[None]] = set()

    # -- tenancy ---------------------------------------------------------------------------

    async def _job_owners(self, job_id: str) -> set[str]:
        """The tenants of ``job_id``'s sessions and snapshots. The sessions are read after the
        last await, so a caller that acts on the answer without awaiting acts atomically."""
        owner = await asyncio.to_thread(self.snapshots.job_owner, job_id) if self.snapshots else None
        return {s.tenant for s in self.registry.sessions if s.job_id == job_id} | ({owner} - {None})

    async def _claim(self, tenant: Tenant, job_id: str) -> None:
        """PermissionDenied unless ``tenant`` may use job id ``job_id``."""
        if not all(tenant.may_claim(owner) for owner in await self._job_owners(job_id)):
            raise PermissionDeniedError(f"job {job_id!r} (its sessions or snapshots) belongs to another tenant: "
                                   "choose another job id")

    def session(self, caller: Tenant, session_id: str, generation: int, *, segment: bool = False) -> Session:
        """The session of (id, current generation), if the caller may reach it; with
        ``segment``, only once it has one."""
        session = self.registry.lookup(session_id, generation)
        caller.check(session.tenant, f"session {session_id} (job {session.job_id!r})")
        if segment and session.segment is None:
            raise NoSegmentError(f"session {session_id} has no segment yet: call Allocate first")
        return session

    def _coordinator(self) -> SnapshotCoordinator:
        if self.snapshots is None:
            raise SnapshotsDisabledError("this server keeps no snapshots: start it with --snapshot-dir DIR")
        return self.snapshots

    # -- sessions --------------------------------------------------------------------------

    async def attach(self, caller: Tenant, job_id: str, rank: int, world_size: int, *, local_world_size: int,
                     client_pid: int, client_host: str) -> tuple[Session, bool]:
        """Open or re-open the session of (job_id, rank) for the caller: (session, reattached)."""
        await self._claim(caller, job_id)  # no await between this and the registry's attach
        return await self.registry.attach(job_id, rank, world_size, client_pid=client_pid, client_host=client_host,
                                          local_world_size=local_world_size, tenant=caller)

    def open_stream(self, caller: Tenant, session_id: str, generation: int) -> LivenessStream:
        return self.registry.open_stream(self.session(caller, session_id, generation), generation)

    async def allocate(self, caller: Tenant, session_id: str, generation: int,
                       specs: Callable[[], list[TensorSpec]]) -> tuple[Segment, bool]:
        """The session's segment for the tensors ``specs()`` checks (run in a worker thread,
        after the session was found): (segment, reused)."""
        session = self.session(caller, session_id, generation)
        return await self.registry.allocate(session, generation, await asyncio.to_thread(specs))

    def commit_step(self, caller: Tenant, session_id: str, generation: int, step: int) -> int:
        return self.registry.commit_step(self.session(caller, session_id, generation), step)

    async def detach(self, caller: Tenant, session_id: str, generation: int, *, keep: bool) -> None:
        await self.registry.detach(self.session(caller, session_id, generation), generation, keep=keep)

    def sessions_of(self, caller: Tenant) -> list[Session]:
        return [s for s in self.registry.sessions if caller.may_reach(s.tenant)]

    def copy_budget_of(self, session: Session) -> tuple[int, int, str]:
        """(slot bytes, bytes needed, warning) of the memory rule for a session's segment."""
        if session.segment is None:
            return 0, 0, ""
        budget = self.arena.copy_policy.budget(session.segment.layout)
        return budget.slot_bytes, budget.needed_bytes, budget.warning() if self.snapshots else ""

    def persist_rates(self) -> tuple[float, bool, float, int]:
        """(persist bytes/s, measured, assumed forward/backward seconds, stage threads)."""
        if self.snapshots is None:
            return 0.0, False, 0.0, 0
        persist, measured = self.snapshots.copy_policy.rate()
        return persist, measured, self.snapshots.copy_policy.fwd_bwd_s, self.snapshots.stage_threads

    def snapshots_in_progress(self, caller: Tenant, sessions: Iterable[Session]) -> list[SnapshotStatus]:
        """The persisting ranks of the jobs of ``sessions`` (an admin: all)."""
        jobs = {s.job_id for s in sessions}
        return [s for s in (self.snapshots.in_progress() if self.snapshots else ()) if caller.admin or s.job_id in jobs]

    # -- snapshots -------------------------------------------------------------------------

    async def snapshot(self, caller: Tenant, session_id: str, generation: int, ask: SnapshotAsk,
                       after_reply: Callable[[Callable[[], None]], None]) -> str:
        """Start the snapshot of the session's committed step ``ask.step``; returns its id once
        it is consistent. ``after_reply(go)``: call ``go`` once the reply is sent (the writer
        streams from then on: a writer already streaming would compete for the GIL and CPUs)."""
        coordinator = self._coordinator()
        session = self.session(caller, session_id, generation, segment=True)
        await self._claim(Tenant(session.tenant), session.job_id)
        async with session.lock:
            if session.last_committed_step != ask.step:
                raise FailedPreconditionError(f"snapshot of step {ask.step} refused: the last committed step of "
                                         f"{session.job_id}/rank {session.rank} is {session.last_committed_step}")
            # The writer reads the segment after the reply; borrow() keeps the mapping alive (a
            # detach or grace expiry waits) until the writer lets go.
            with contextlib.ExitStack() as stack:
                parts = await self._metadata_parts(session, ask, coordinator.max_metadata_bytes)
                source = SnapshotSource.of(session, stack.enter_context(session.segment.borrow()), ask,
                                           metadata_parts=parts, bounded_retention=not caller.admin)
                try:
                    handle = await asyncio.to_thread(coordinator.start, source, hold=True)
                except SnapshotAlreadyFailed:
                    # One contract whatever the timing: the failure shows on the handle (its
                    # status), for this rank as for the ranks that were there.
                    return snapshot_id_for(session.job_id, ask.step)
                held = stack.pop_all()  # started: _finish returns the mapping
        after_reply(handle.proceed)
        self.snapshot_counters["started"] += 1
        task = asyncio.get_running_loop().create_task(self._finish(handle, held))
        self._finishing.add(task)
        task.add_done_callback(self._finished)
        return handle.snapshot_id

    @staticmethod
    async def _metadata_parts(session: Session, ask: SnapshotAsk, max_bytes: int) -> MetadataParts | None:
        """The metadata as a base and a delta (None: none sent). A base sent along is validated
        and kept with the session; one only named must be the one kept (else
        METADATA_BASE_UNKNOWN: the trainer sends it again)."""
        if not ask.metadata_base_id:
            return None
        if ask.metadata_base_json:
            if base_id(ask.metadata_base_json) != ask.metadata_base_id:
                raise InvalidRequestError("metadata_base_id is not the digest of metadata_base_json")
            base = await asyncio.to_thread(parse_base, ask.metadata_base_json, session.layout.tensors, max_bytes)
            session.metadata_base = (ask.metadata_base_id, base)
        held = session.metadata_base
        if held is None or held[0] != ask.metadata_base_id:
            raise MetadataBaseUnknownError(
                f"this server does not hold the snapshot metadata base {ask.metadata_base_id} of "
                f"{session.job_id}/rank {session.rank} (it restarted since the trainer sent it): send it again")
        return parse_delta(ask.metadata_delta_json, held[1], max_bytes)

    async def _finish(self, handle: RankSnapshot, held: contextlib.ExitStack) -> None:
        """Return the borrowed mapping once the writer is done with it, then count the result
        once the group is settled. Awaits without holding a thread: a rank may wait minutes."""
        with held:
            await handle.segment_released.wait_async()
        self.snapshot_counters.record(await handle.wait_async())

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._finishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(log, "snapshot_finish_failed", logging.ERROR, error=repr(task.exception()))

    async def drain(self, timeout_s: float | None = None) -> None:
        """Await the tasks that return borrowed segments (at shutdown, after the coordinator
        has let its writers finish)."""
        if self._finishing:
            await asyncio.wait(set(self._finishing), timeout=timeout_s)

    async def snapshot_status(self, caller: Tenant, snapshot_id: str, rank: int, wait_s: float,
                              wait_stored: bool, wait_replicated: bool = False) -> SnapshotStatus:
        """A rank's status after waiting up to ``wait_s`` (at most :data:`MAX_STATUS_WAIT_S`)."""
        coordinator = self._coordinator()
        for tenant in await self._job_owners(parse_snapshot_id(snapshot_id, None, InvalidRequestError).job_id):
            caller.check(tenant, f"snapshot {snapshot_id}")
        wait_s = min(max(wait_s, 0.0), MAX_STATUS_WAIT_S)
        return await coordinator.wait_status(snapshot_id, rank, wait_s, wait_stored, wait_replicated)

    async def list_snapshots(self, caller: Tenant, job_id: str | None
                             ) -> tuple[list[tuple[SnapshotInfo | None, SnapshotInfo | None, Any]], str]:
        """(local, stored, replica state) of each snapshot the caller may see, and the store's
        error ("": none)."""
        coordinator = self._coordinator()
        listed, store_error = await asyncio.to_thread(list_both_tiers, coordinator, job_id)
        states = coordinator.replica_states
        return [(local, stored, states and states.state((local or stored).job_id, (local or stored).step))
                for local, stored in listed
                if caller.may_reach((local or stored).index.tenant)], store_error  # type: ignore[union-attr]

    async def restore(self, caller: Tenant, session_id: str, generation: int, snapshot_id: str,
                      placement_json: str) -> RestoreResult:
        """Read ``snapshot_id`` into the session's segment; the session's step becomes its."""
        coordinator = self._coordinator()
        session = self.session(caller, session_id, generation, segment=True)
        arena = self.arena
        async with session.lock:
            with session.segment.borrow() as buffer:
                result = await asyncio.to_thread(
                    restore, coordinator.host, snapshot_id, buffer, session.layout, rank=session.rank,
                    world_size=session.world_size, job_id=session.job_id, header=session.header,
                    reserve_staging=arena.reserve_staging, staging_free_bytes=lambda: arena.free_bytes,
                    stored=coordinator.stored, placement_json=placement_json,
                    may_read=lambda info: caller.check(info.index.tenant, f"snapshot {info.snapshot_id}"))
            session.record_commit(result.step, force=True)
        return result
