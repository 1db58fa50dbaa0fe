"""The gRPC servicer: protobuf <-> domain, nothing else.

Every id a request carries is validated here, first thing, with :mod:`.validation` (the one
place for bad input; the domain trusts what it gets). State lives in :mod:`.sessions` /
:mod:`.arena`; status codes are mapped by :func:`~swap_state.server.rpc.statuses.rpc_boundary`.
"""

from __future__ import annotations

import asyncio
import time

from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc

from swap_state.common.errors import PermissionDenied, Unauthenticated
from swap_state.server.memory.arena import Arena
from swap_state.server.memory.segment_file import Segment
from swap_state.server.memory.session import Session
from swap_state.server.memory.sessions import SessionRegistry
from swap_state.server.snapshot.coordinator import SnapshotCoordinator
from swap_state.server.rpc.snapshot_service import SnapshotRpcs, status_reply
from swap_state.server.rpc.statuses import RpcCounters, rpc_boundary
from swap_state.server.tenants import Tenant, Tenants
from swap_state.server.rpc.validation import (
    validate_client_host,
    validate_job_id,
    validate_local_world_size,
    validate_rank,
    validate_session,
    validate_step,
    validate_tensor_specs,
)

__all__ = ["SwapStateService", "segment_info"]

# Building a reply for this many tensors takes long enough to do it off the loop.
_OFFLOAD_TENSORS = 4096


def segment_info(segment: Segment) -> pb.SegmentInfo:
    layout = segment.layout
    return pb.SegmentInfo(
        path=str(segment.path),
        size=segment.size,
        header_bytes=layout.header_bytes,
        tensors=[
            pb.TensorPlacement(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset,
                               nbytes=t.nbytes)
            for t in layout.tensors
        ],
        chunk_bytes=layout.chunk_bytes,
        cow_slots=layout.cow_slots,
        cow_slots_offset=layout.cow_slots_offset,
        layout_hash=segment.layout_hash,
    )


async def _segment_info(segment: Segment) -> pb.SegmentInfo:
    if len(segment.layout.tensors) > _OFFLOAD_TENSORS:
        return await asyncio.to_thread(segment_info, segment)
    return segment_info(segment)


def _now_ms() -> int:
    return int(time.time() * 1000)


class SwapStateService(pb_grpc.SwapStateServicer):
    def __init__(
        self,
        registry: SessionRegistry,
        arena: Arena,
        *,
        keepalive_interval: float,
        counters: RpcCounters,
        snapshots: SnapshotCoordinator | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.tenants = tenants or Tenants()
        """Who calls (:mod:`swap_state.server.tenants`): each call's tenant from its token."""
        self.registry = registry
        self.snapshots = snapshots
        self.snapshot_rpcs = SnapshotRpcs(registry, arena, snapshots)
        self.snapshot_counters = self.snapshot_rpcs.snapshot_counters
        self.arena = arena
        self.keepalive_interval = keepalive_interval
        self.counters = counters  # used by rpc_boundary

    def _caller(self, context) -> Tenant:
        """The call's tenant (the interceptor has refused calls without a known token)."""
        tenant = self.tenants.tenant_of(context.invocation_metadata())
        if tenant is None:
            raise Unauthenticated("missing or wrong token")
        return tenant

    def _own_session(self, caller: Tenant, session_id: str, generation: int) -> Session:
        """The session, if its tenant is the caller's (or the caller is an admin)."""
        session = self.registry.lookup(session_id, generation)
        caller.check(session.tenant, f"session {session_id} (job {session.job_id!r})")
        return session

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
        session, reattached = await self.registry.attach(
            request.job_id,
            request.rank,
            request.world_size,
            client_pid=request.client_pid,
            client_host=request.client_host,
            local_world_size=local_world_size,
            tenant=caller,
        )
        reply = pb.AttachReply(
            session_id=session.session_id,
            generation=session.generation,
            reattached=reattached,
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
        validate_session(request.session_id, request.generation)
        self._own_session(self._caller(context), request.session_id, request.generation)
        stream = self.registry.open_stream(request.session_id, request.generation)
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
        validate_session(request.session_id, request.generation)
        self._own_session(self._caller(context), request.session_id, request.generation)  # unknown or stale: first
        # A generator: the O(tensors) conversion and checks run in a worker thread, off the loop.
        specs = ((t.name, t.dtype, t.shape) for t in request.tensors)
        checked = await asyncio.to_thread(validate_tensor_specs, specs, max_tensors=self.registry.max_tensors)
        segment, reused = await self.registry.allocate(request.session_id, request.generation, checked)
        return pb.AllocateReply(segment=await _segment_info(segment), reused=reused)

    @rpc_boundary
    async def CommitStep(self, request: pb.CommitStepRequest, context) -> pb.CommitStepReply:
        validate_step(request.step)
        validate_session(request.session_id, request.generation)
        self._own_session(self._caller(context), request.session_id, request.generation)
        step = self.registry.commit_step(request.session_id, request.generation, request.step)
        return pb.CommitStepReply(committed_step=step)

    @rpc_boundary
    async def Detach(self, request: pb.DetachRequest, context) -> pb.DetachReply:
        validate_session(request.session_id, request.generation)
        self._own_session(self._caller(context), request.session_id, request.generation)
        await self.registry.detach(request.session_id, request.generation, keep=request.keep)
        return pb.DetachReply()

    @rpc_boundary
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        caller = self._caller(context)
        sessions = [s for s in self.registry.sessions if caller.may_reach(s.tenant)]
        jobs = {s.job_id for s in sessions}
        in_progress = self.snapshots.in_progress() if self.snapshots else ()
        if self.snapshots is not None:
            persist, measured = self.snapshots.persist_bandwidth()
            fwd_bwd, stage_threads = self.snapshots.assumed_fwd_bwd_s, self.snapshots.stage_threads
        else:
            persist, measured, fwd_bwd, stage_threads = 0.0, False, 0.0, 0
        return pb.StatsReply(
            budget_total_bytes=self.arena.total_bytes,
            budget_used_bytes=self.arena.used_bytes,
            budget_free_bytes=self.arena.free_bytes,
            sessions=[self._session_stats(s) for s in sessions],
            steps_committed_total=self.registry.steps_committed_total,
            snapshots_in_progress=[status_reply(s) for s in in_progress if caller.admin or s.job_id in jobs],
            persist_bytes_per_second=persist,
            persist_bandwidth_measured=measured,
            assumed_fwd_bwd_seconds=fwd_bwd,
            stage_threads=stage_threads,
            cow_pool_bytes=self.arena.cow_reserve_bytes,
            cow_pool_used_bytes=self.arena.cow_used_bytes,
            sessions_adopted_total=self.registry.sessions_adopted,
            reconnects_total=self.registry.reconnects,
        )

    def _session_stats(self, session: Session) -> pb.SessionStats:
        budget = None
        if session.segment is not None:
            layout = session.segment.layout
            budget = self.arena.copy_budget(layout)  # the server's one policy, shared with its snapshots
        return pb.SessionStats(
            session_id=session.session_id,
            job_id=session.job_id,
            rank=session.rank,
            world_size=session.world_size,
            local_world_size=session.local_world_size,
            generation=session.generation,
            state=session.state.value,
            segment_bytes=session.segment.file_bytes if session.segment else 0,
            model_bytes=session.segment.model_bytes if session.segment else 0,
            last_committed_step=session.last_committed_step or 0,
            has_committed_step=session.last_committed_step is not None,
            steps_committed=session.steps_committed,
            orphaned_seconds=self.registry.orphaned_seconds(session),
            copy_slot_bytes=budget.slot_bytes if budget else 0,
            copy_budget_needed_bytes=budget.needed_bytes if budget else 0,
            copy_budget_warning=budget.warning() if budget and self.snapshots else "",
            adopted=session.adopted,
        )


    # -- snapshots: SnapshotRpcs does the work, behind this service's boundary ------------
    @rpc_boundary
    async def Snapshot(self, request: pb.SnapshotRequest, context) -> pb.SnapshotReply:
        return await self.snapshot_rpcs.Snapshot(request, context, self._caller(context))

    @rpc_boundary
    async def SnapshotStatus(self, request: pb.SnapshotStatusRequest, context) -> pb.SnapshotStatusReply:
        return await self.snapshot_rpcs.SnapshotStatus(request, context, self._caller(context))

    @rpc_boundary
    async def ListSnapshots(self, request: pb.ListSnapshotsRequest, context) -> pb.ListSnapshotsReply:
        return await self.snapshot_rpcs.ListSnapshots(request, context, self._caller(context))

    @rpc_boundary
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreReply:
        return await self.snapshot_rpcs.Restore(request, context, self._caller(context))