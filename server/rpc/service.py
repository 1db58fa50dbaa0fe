"""The gRPC servicer: protobuf <-> domain, nothing else.

Each method validates its request with :mod:`.validation` (the one place for bad input; the domain trusts what it gets),
takes the caller's tenant the authentication resolved (:func:`.auth.caller`), calls one method of
:class:`~swap_state.server.domain.StateServer` and builds the reply;
:func:`~swap_state.server.rpc.statuses.rpc_boundary` maps the domain's errors to status codes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc

from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.server.domain import SnapshotAsk, StateServer
from swap_state.server.memory.arena import Segment
from swap_state.server.memory.session import Session
from swap_state.server.observability.metrics import RpcCounters
from swap_state.server.rpc.auth import caller
from swap_state.server.rpc.statuses import rpc_boundary
from swap_state.server.snapshot.status import SnapshotStatus
from swap_state.server.rpc.validation import (
    validate_client_host, validate_job_id, validate_local_world_size, validate_rank,
    validate_session, validate_snapshot_id, validate_snapshot_rank, validate_step, validate_tensor_specs)

__all__ = ["SwapStateService", "segment_info"]

R = TypeVar("R")


def reply_of(reply: type[R], value: Any, **given: Any) -> R:
    """A ``reply`` whose every field not ``given`` is ``value``'s attribute of the same name."""
    fields = {f.name: getattr(value, f.name) for f in reply.DESCRIPTOR.fields if f.name not in given}  # type: ignore[attr-defined]
    return reply(**fields, **given)


def status_reply(status: SnapshotStatus) -> pb.SnapshotStatusReply:
    return reply_of(pb.SnapshotStatusReply, status, state=status.state.value)


def info_reply(local: SnapshotInfo | None, stored: SnapshotInfo | None, replica: Any = None) -> pb.SnapshotInfo:
    """One listed snapshot: its local facts (path, this host's ranks) and where it is in the
    store, and its replica's state (a ``ReplicaState``) if any; ``latest`` as the tier the server
    would restore ``latest`` from says."""
    first = local or stored
    assert first is not None
    return reply_of(pb.SnapshotInfo, first, local=local is not None, path=str(local.path) if local else "",
                    stored=stored is not None, store_path=str(stored.path) if stored else "",
                    replica_state=replica.state if replica else "", replica_peer=replica.peer if replica else "")


# Building a reply for this many tensors takes long enough to do it off the loop.
_OFFLOAD_TENSORS = 4096


def segment_info(segment: Segment) -> pb.SegmentInfo:
    tensors = [pb.TensorPlacement(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset, nbytes=t.nbytes)
               for t in segment.layout.tensors]
    return reply_of(pb.SegmentInfo, segment.layout, path=str(segment.path), tensors=tensors,
                    layout_hash=segment.layout_hash)


async def _segment_info(segment: Segment) -> pb.SegmentInfo:
    if len(segment.layout.tensors) > _OFFLOAD_TENSORS:
        return await asyncio.to_thread(segment_info, segment)
    return segment_info(segment)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _after_reply(context):
    """``go`` runs once the call's reply is sent (at once where the context cannot say)."""
    def register(go):
        try:
            context.add_done_callback(lambda _context: go())
        except Exception:  # no termination callback: let it go now
            go()
    return register


class SwapStateService(pb_grpc.SwapStateServicer):
    """Every RPC of the SwapState service, over one :class:`StateServer`."""

    def __init__(self, state: StateServer, *, keepalive_interval: float) -> None:
        self.state = state
        self.keepalive_interval = keepalive_interval
        self.counters = RpcCounters()  # counted by rpc_boundary

    @rpc_boundary
    async def Attach(self, request: pb.AttachRequest, context) -> pb.AttachReply:
        validate_job_id(request.job_id)
        validate_rank(request.rank, request.world_size)
        local_world_size = validate_local_world_size(request.local_world_size, request.world_size)
        validate_client_host(request.client_host)
        session, reattached = await self.state.attach(
            caller(), request.job_id, request.rank, request.world_size, local_world_size=local_world_size,
            client_pid=request.client_pid, client_host=request.client_host)
        segment, step = session.segment, session.last_committed_step
        previous = "" if reattached else self.state.registry.why_no_state(request.job_id, request.rank)
        return reply_of(pb.AttachReply, session, reattached=reattached, has_segment=segment is not None,
                        has_committed_step=step is not None, last_committed_step=step or 0, previous_session=previous,
                        keepalive_interval_ms=int(self.keepalive_interval * 1000),
                        segment=await _segment_info(segment) if segment is not None else None)

    @rpc_boundary
    async def KeepAlive(self, request: pb.KeepAliveRequest, context):
        validate_session(request.session_id, request.generation)
        stream = self.state.open_stream(caller(), request.session_id, request.generation)
        try:
            reason = None
            while reason is None:
                yield pb.KeepAliveEvent(server_time_ms=_now_ms())
                reason = await stream.wait_end(self.keepalive_interval)
            yield pb.KeepAliveEvent(server_time_ms=_now_ms(), notice=reason)  # says why, then the stream ends with OK
        finally:
            self.state.registry.close_stream(stream)

    @rpc_boundary
    async def Allocate(self, request: pb.AllocateRequest, context) -> pb.AllocateReply:
        validate_session(request.session_id, request.generation)
        max_tensors = self.state.registry.max_tensors
        # O(tensors): the domain checks them in a worker thread, once the session is found.
        specs = ((t.name, t.dtype, t.shape) for t in request.tensors)
        segment, reused = await self.state.allocate(caller(), request.session_id, request.generation,
                                                    lambda: validate_tensor_specs(specs, max_tensors=max_tensors))
        return pb.AllocateReply(segment=await _segment_info(segment), reused=reused)

    @rpc_boundary
    async def CommitStep(self, request: pb.CommitStepRequest, context) -> pb.CommitStepReply:
        validate_step(request.step)
        validate_session(request.session_id, request.generation)
        step = self.state.commit_step(caller(), request.session_id, request.generation, request.step)
        return pb.CommitStepReply(committed_step=step)

    @rpc_boundary
    async def Detach(self, request: pb.DetachRequest, context) -> pb.DetachReply:
        validate_session(request.session_id, request.generation)
        await self.state.detach(caller(), request.session_id, request.generation, keep=request.keep)
        return pb.DetachReply()

    @rpc_boundary
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        tenant, state, arena, registry = caller(), self.state, self.state.arena, self.state.registry
        sessions = state.sessions_of(tenant)
        persist, measured, fwd_bwd, stage_threads = state.persist_rates()
        return pb.StatsReply(
            budget_total_bytes=arena.total_bytes, budget_used_bytes=arena.used_bytes,
            budget_free_bytes=arena.free_bytes, sessions=[self._session_stats(s) for s in sessions],
            steps_committed_total=registry.steps_committed_total,
            snapshots_in_progress=[status_reply(s) for s in state.snapshots_in_progress(tenant, sessions)],
            persist_bytes_per_second=persist, persist_bandwidth_measured=measured,
            assumed_fwd_bwd_seconds=fwd_bwd, stage_threads=stage_threads,
            cow_pool_bytes=arena.cow_reserve_bytes, cow_pool_used_bytes=arena.cow_used_bytes,
            sessions_adopted_total=registry.sessions_adopted, reconnects_total=registry.reconnects)

    def _session_stats(self, session: Session) -> pb.SessionStats:
        segment, step = session.segment, session.last_committed_step
        slot_bytes, needed_bytes, warning = self.state.copy_budget_of(session)
        return reply_of(pb.SessionStats, session, state=session.state.value, last_committed_step=step or 0,
                        segment_bytes=segment.file_bytes if segment else 0, has_committed_step=step is not None,
                        model_bytes=segment.model_bytes if segment else 0, copy_slot_bytes=slot_bytes,
                        orphaned_seconds=self.state.registry.orphaned_seconds(session),
                        copy_budget_needed_bytes=needed_bytes, copy_budget_warning=warning)

    @rpc_boundary
    async def Snapshot(self, request: pb.SnapshotRequest, context) -> pb.SnapshotReply:
        validate_session(request.session_id, request.generation)  # a bad id first, whatever else
        validate_step(request.step)
        ask = SnapshotAsk(**{name: getattr(request, name) for name in SnapshotAsk.__dataclass_fields__})
        snapshot_id = await self.state.snapshot(caller(), request.session_id, request.generation, ask,
                                                after_reply=_after_reply(context))
        return pb.SnapshotReply(snapshot_id=snapshot_id, consistent=True)

    @rpc_boundary
    async def SnapshotStatus(self, request: pb.SnapshotStatusRequest, context) -> pb.SnapshotStatusReply:
        snapshot_id = validate_snapshot_id(request.snapshot_id, relative=False, latest=False)
        validate_snapshot_rank(request.rank)
        return status_reply(await self.state.snapshot_status(caller(), snapshot_id, request.rank, request.wait_seconds,
                                                             request.wait_stored, request.wait_replicated))

    @rpc_boundary
    async def ListSnapshots(self, request: pb.ListSnapshotsRequest, context) -> pb.ListSnapshotsReply:
        job_id = validate_job_id(request.job_id) if request.job_id else None  # "": all jobs
        listed, store_error = await self.state.list_snapshots(caller(), job_id)
        return pb.ListSnapshotsReply(snapshots=[info_reply(*found) for found in listed], store_error=store_error)

    @rpc_boundary
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreReply:
        validate_session(request.session_id, request.generation)  # a bad id first, whatever else
        snapshot_id = validate_snapshot_id(request.snapshot_id or "latest", relative=True, latest=True)
        return reply_of(pb.RestoreReply, await self.state.restore(caller(), request.session_id, request.generation,
                                                                  snapshot_id, request.metadata_json))
