"""The gRPC servicer: protobuf <-> domain, nothing else.

Every id a request carries is validated here, first thing, with :mod:`.validation` (the one
place for bad input; the domain trusts what it gets). State lives in :mod:`.sessions` /
:mod:`.arena` and the snapshot coordinator; status codes are mapped by
:func:`~swap_state.server.rpc.statuses.rpc_boundary`. Blocking work (starting a snapshot, a
restore, reading a status from disk) runs in worker threads; waits for a writer or a group are
awaited holding no thread (:mod:`..snapshot.waiting`), so waiting ranks never starve the
executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc

from swap_state.common.errors import (
    FailedPrecondition, InvalidArgument, NoSegment, PermissionDenied, SnapshotsDisabled, Unauthenticated,
)
from swap_state.common.names import parse_snapshot_id, snapshot_id_for
from swap_state.server.logs import log_event
from swap_state.server.memory.arena import Segment
from swap_state.server.memory.session import Session
from swap_state.server.memory.sessions import SessionRegistry
from swap_state.server.snapshot.coordinator import SnapshotCoordinator
from swap_state.server.snapshot.group import SnapshotAlreadyFailed
from swap_state.server.snapshot.restore import restore
from swap_state.server.snapshot.source import SnapshotSource
from swap_state.server.snapshot.tiers import list_both_tiers
from swap_state.server.rpc.snapshot_service import (
    MAX_STATUS_WAIT_S, finish_snapshot, info_reply, metadata_parts, status_reply,
)
from swap_state.server.observability.metrics import RpcCounters, SnapshotCounters
from swap_state.server.rpc.statuses import rpc_boundary
from swap_state.server.tenants import Tenant, Tenants
from swap_state.server.rpc.validation import (
    validate_client_host, validate_job_id, validate_local_world_size, validate_rank,
    validate_session, validate_snapshot_id, validate_snapshot_rank, validate_step, validate_tensor_specs,
)

__all__ = ["SwapStateService", "segment_info"]

log = logging.getLogger("swap_state.server.rpc")

# Building a reply for this many tensors takes long enough to do it off the loop.
_OFFLOAD_TENSORS = 4096


def segment_info(segment: Segment) -> pb.SegmentInfo:
    layout = segment.layout
    return pb.SegmentInfo(
        path=str(segment.path), size=segment.size, header_bytes=layout.header_bytes,
        tensors=[
            pb.TensorPlacement(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset,
                               nbytes=t.nbytes)
            for t in layout.tensors
        ],
        chunk_bytes=layout.chunk_bytes, cow_slots=layout.cow_slots,
        cow_slots_offset=layout.cow_slots_offset, layout_hash=segment.layout_hash,
    )


async def _segment_info(segment: Segment) -> pb.SegmentInfo:
    if len(segment.layout.tensors) > _OFFLOAD_TENSORS:
        return await asyncio.to_thread(segment_info, segment)
    return segment_info(segment)


def _now_ms() -> int:
    return int(time.time() * 1000)


class SwapStateService(pb_grpc.SwapStateServicer):
    """Every RPC of the SwapState service. ``snapshots``: the coordinator, or None without
    --snapshot-dir (the snapshot RPCs then fail naming the flag)."""

    def __init__(self, registry: SessionRegistry, *, keepalive_interval: float,
                 snapshots: SnapshotCoordinator | None = None, tenants: Tenants | None = None) -> None:
        self.tenants = tenants or Tenants()
        """Who calls (:mod:`swap_state.server.tenants`): each call's tenant from its token."""
        self.registry = registry
        self.snapshots = snapshots
        self.snapshot_counters = SnapshotCounters()
        self.arena = registry.arena
        self.keepalive_interval = keepalive_interval
        self.counters = RpcCounters()  # counted by rpc_boundary
        self._finishing: set[asyncio.Task[None]] = set()

    def _caller(self, context) -> Tenant:
        """The call's tenant (the interceptor has refused calls without a known token)."""
        tenant = self.tenants.tenant_of(context.invocation_metadata())
        if tenant is None:
            raise Unauthenticated("missing or wrong token")
        return tenant

    def _own_session(self, caller: Tenant, session_id: str, generation: int, *, segment: bool = False) -> Session:
        """The session of a valid (id, current generation), if its tenant is the caller's (or
        the caller is an admin); with ``segment``, only once it has one."""
        validate_session(session_id, generation)
        session = self.registry.lookup(session_id, generation)
        caller.check(session.tenant, f"session {session_id} (job {session.job_id!r})")
        if segment and session.segment is None:
            raise NoSegment(f"session {session_id} has no segment yet: call Allocate first")
        return session

    def _coordinator(self) -> SnapshotCoordinator:
        if self.snapshots is None:
            raise SnapshotsDisabled("this server keeps no snapshots: start it with --snapshot-dir DIR")
        return self.snapshots

    @rpc_boundary
    async def Attach(self, request: pb.AttachRequest, context) -> pb.AttachReply:
        validate_job_id(request.job_id)
        validate_rank(request.rank, request.world_size)
        local_world_size = validate_local_world_size(request.local_world_size, request.world_size)
        validate_client_host(request.client_host)
        caller = self._caller(context)
        owner = await asyncio.to_thread(self.snapshots.job_owner, request.job_id) if self.snapshots else None
        if not caller.may_claim(owner):
            raise PermissionDenied(f"the snapshots of job {request.job_id!r} belong to another tenant: "
                                   "choose another job id")
        session, reattached = await self.registry.attach(request.job_id, request.rank, request.world_size,
                                                         client_pid=request.client_pid, client_host=request.client_host,
                                                         local_world_size=local_world_size, tenant=caller)
        reply = pb.AttachReply(
            session_id=session.session_id, generation=session.generation, reattached=reattached,
            has_segment=session.segment is not None,
            has_committed_step=session.last_committed_step is not None,
            last_committed_step=session.last_committed_step or 0,
            keepalive_interval_ms=int(self.keepalive_interval * 1000),
            previous_session="" if reattached else self.registry.why_no_state(request.job_id, request.rank),
        )
        if session.segment is not None:
            reply.segment.CopyFrom(await _segment_info(session.segment))
        return reply

    @rpc_boundary
    async def KeepAlive(self, request: pb.KeepAliveRequest, context):
        session = self._own_session(self._caller(context), request.session_id, request.generation)
        stream = self.registry.open_stream(session, request.generation)
        try:
            while True:
                yield pb.KeepAliveEvent(server_time_ms=_now_ms())
                reason = await stream.wait_end(self.keepalive_interval)
                if reason is not None:
                    # A last event says why, then the stream ends with OK.
                    yield pb.KeepAliveEvent(server_time_ms=_now_ms(), notice=reason)
                    return
        finally:
            self.registry.close_stream(stream)

    @rpc_boundary
    async def Allocate(self, request: pb.AllocateRequest, context) -> pb.AllocateReply:
        session = self._own_session(self._caller(context), request.session_id, request.generation)  # first
        # A generator: the O(tensors) conversion and checks run in a worker thread, off the loop.
        specs = ((t.name, t.dtype, t.shape) for t in request.tensors)
        checked = await asyncio.to_thread(validate_tensor_specs, specs, max_tensors=self.registry.max_tensors)
        segment, reused = await self.registry.allocate(session, request.generation, checked)
        return pb.AllocateReply(segment=await _segment_info(segment), reused=reused)

    @rpc_boundary
    async def CommitStep(self, request: pb.CommitStepRequest, context) -> pb.CommitStepReply:
        validate_step(request.step)
        session = self._own_session(self._caller(context), request.session_id, request.generation)
        step = self.registry.commit_step(session, request.step)
        return pb.CommitStepReply(committed_step=step)

    @rpc_boundary
    async def Detach(self, request: pb.DetachRequest, context) -> pb.DetachReply:
        session = self._own_session(self._caller(context), request.session_id, request.generation)
        await self.registry.detach(session, request.generation, keep=request.keep)
        return pb.DetachReply()

    @rpc_boundary
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        caller = self._caller(context)
        sessions = [s for s in self.registry.sessions if caller.may_reach(s.tenant)]
        jobs = {s.job_id for s in sessions}
        in_progress = self.snapshots.in_progress() if self.snapshots else ()
        if self.snapshots is not None:
            persist, measured = self.snapshots.copy_policy.rate()
            fwd_bwd, stage_threads = self.snapshots.copy_policy.fwd_bwd_s, self.snapshots.stage_threads
        else:
            persist, measured, fwd_bwd, stage_threads = 0.0, False, 0.0, 0
        return pb.StatsReply(
            budget_total_bytes=self.arena.total_bytes, budget_used_bytes=self.arena.used_bytes,
            budget_free_bytes=self.arena.free_bytes, sessions=[self._session_stats(s) for s in sessions],
            steps_committed_total=self.registry.steps_committed_total,
            snapshots_in_progress=[status_reply(s) for s in in_progress if caller.admin or s.job_id in jobs],
            persist_bytes_per_second=persist, persist_bandwidth_measured=measured,
            assumed_fwd_bwd_seconds=fwd_bwd, stage_threads=stage_threads,
            cow_pool_bytes=self.arena.cow_reserve_bytes, cow_pool_used_bytes=self.arena.cow_used_bytes,
            sessions_adopted_total=self.registry.sessions_adopted, reconnects_total=self.registry.reconnects,
        )

    def _session_stats(self, session: Session) -> pb.SessionStats:
        segment = session.segment
        budget = self.arena.copy_policy.budget(segment.layout) if segment is not None else None
        return pb.SessionStats(session_id=session.session_id, job_id=session.job_id, rank=session.rank,
                               world_size=session.world_size, local_world_size=session.local_world_size,
                               generation=session.generation, state=session.state.value,
                               segment_bytes=segment.file_bytes if segment else 0,
                               model_bytes=segment.model_bytes if segment else 0,
                               last_committed_step=session.last_committed_step or 0,
                               has_committed_step=session.last_committed_step is not None,
                               steps_committed=session.steps_committed,
                               orphaned_seconds=self.registry.orphaned_seconds(session),
                               copy_slot_bytes=budget.slot_bytes if budget else 0,
                               copy_budget_needed_bytes=budget.needed_bytes if budget else 0,
                               copy_budget_warning=budget.warning() if budget and self.snapshots else "",
                               adopted=session.adopted)

    @rpc_boundary
    async def Snapshot(self, request: pb.SnapshotRequest, context) -> pb.SnapshotReply:
        caller = self._caller(context)
        validate_session(request.session_id, request.generation)  # a bad id first, whatever else
        validate_step(request.step)
        coordinator = self._coordinator()
        session = self._own_session(caller, request.session_id, request.generation, segment=True)
        async with session.lock:
            if session.last_committed_step != request.step:
                raise FailedPrecondition(f"snapshot of step {request.step} refused: the last committed step of "
                                         f"{session.job_id}/rank {session.rank} is {session.last_committed_step}")
            # The writer reads the segment after this reply; borrow() keeps the mapping
            # alive (a detach or grace expiry waits) until the writer lets go.
            with contextlib.ExitStack() as stack:
                parts = await metadata_parts(session, request, coordinator.max_metadata_bytes)
                buffer = stack.enter_context(session.segment.borrow())
                source = SnapshotSource(buffer, session.layout, session.header, session.job_id, session.rank,
                                        session.world_size, request.step, request.metadata_json, metadata_parts=parts,
                                        local_world_size=session.local_world_size, keep_latest=request.keep_latest,
                                        keep_all=request.keep_all, replace_existing=request.replace_existing,
                                        session_id=session.session_id, generation=session.generation,
                                        tenant=session.tenant, bounded_retention=not caller.admin)
                # hold: the writer streams once this reply is sent (the trainer's stall is
                # this RPC; a writer already streaming would compete for the GIL and CPUs).
                try:
                    handle = await asyncio.to_thread(coordinator.start, source, hold=True)
                except SnapshotAlreadyFailed:
                    # One contract whatever the timing: the failure shows on the handle (its
                    # status), for this rank as for the ranks that were there.
                    return pb.SnapshotReply(snapshot_id=snapshot_id_for(session.job_id, request.step), consistent=True)
                held = stack.pop_all()  # started: finish_snapshot returns the mapping
        try:
            context.add_done_callback(lambda _context: handle.proceed())
        except Exception:  # no termination callback: let the writer go now
            handle.proceed()
        self.snapshot_counters["started"] += 1
        task = asyncio.get_running_loop().create_task(finish_snapshot(handle, held, self.snapshot_counters))
        self._finishing.add(task)
        task.add_done_callback(self._finished)
        return pb.SnapshotReply(snapshot_id=handle.snapshot_id, consistent=True)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._finishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(log, "snapshot_finish_failed", logging.ERROR, error=repr(task.exception()))

    async def drain(self, timeout_s: float | None = None) -> None:
        """Await the tasks that return borrowed segments (at shutdown, after the coordinator
        has let its writers finish)."""
        if self._finishing:
            await asyncio.wait(set(self._finishing), timeout=timeout_s)

    @rpc_boundary
    async def SnapshotStatus(self, request: pb.SnapshotStatusRequest, context) -> pb.SnapshotStatusReply:
        caller = self._caller(context)
        snapshot_id = validate_snapshot_id(request.snapshot_id, relative=False, latest=False)
        validate_snapshot_rank(request.rank)
        coordinator = self._coordinator()
        job_id = parse_snapshot_id(snapshot_id, None, InvalidArgument).job_id
        owners = {s.tenant for s in self.registry.sessions if s.job_id == job_id}
        owner = await asyncio.to_thread(coordinator.job_owner, job_id)
        for tenant in owners | ({owner} if owner is not None else set()):
            caller.check(tenant, f"snapshot {snapshot_id}")
        wait_s = min(max(request.wait_seconds, 0.0), MAX_STATUS_WAIT_S)
        status = await coordinator.wait_status(snapshot_id, request.rank, wait_s, request.wait_stored)
        return status_reply(status)

    @rpc_boundary
    async def ListSnapshots(self, request: pb.ListSnapshotsRequest, context) -> pb.ListSnapshotsReply:
        caller = self._caller(context)
        job_id = validate_job_id(request.job_id) if request.job_id else None  # "": all jobs
        listed, store_error = await asyncio.to_thread(list_both_tiers, self._coordinator(), job_id)
        return pb.ListSnapshotsReply(snapshots=[
            info_reply(local, stored) for local, stored in listed
            if caller.may_reach((local or stored).index.tenant)  # type: ignore[union-attr]
        ], store_error=store_error)

    @rpc_boundary
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreReply:
        caller = self._caller(context)
        validate_session(request.session_id, request.generation)  # a bad id first, whatever else
        snapshot_id = validate_snapshot_id(request.snapshot_id or "latest", relative=True, latest=True)
        coordinator = self._coordinator()
        session = self._own_session(caller, request.session_id, request.generation, segment=True)
        async with session.lock:
            with session.segment.borrow() as buffer:
                result = await asyncio.to_thread(
                    restore, coordinator.directory, snapshot_id, buffer,
                    session.layout, rank=session.rank, world_size=session.world_size,
                    job_id=session.job_id, header=session.header,
                    reserve_staging=self.arena.reserve_staging,
                    staging_free_bytes=lambda: self.arena.free_bytes,
                    stored=coordinator.stored, placement_json=request.metadata_json,
                    may_read=lambda info: caller.check(info.index.tenant, f"snapshot {info.snapshot_id}"),
                )
            session.record_commit(result.step, force=True)
        return pb.RestoreReply(snapshot_id=result.snapshot_id, step=result.step, metadata_json=result.metadata_json,
                               source=result.source, snapshot_world_size=result.snapshot_world_size,
                               source_ranks=result.source_ranks)
