"""Snapshot and restore RPCs: protobuf <-> the snapshot domain (:mod:`.snapshot_coordinator`,
:mod:`.restore`).

:class:`SnapshotRpcs` is held by :class:`~swap_state.server.rpc.service.SwapStateService`,
whose methods of the same names call it behind the one ``rpc_boundary`` (status codes); ids
are validated here, first thing (:mod:`.validation`). Blocking work (starting a snapshot,
verifying and copying a restore, reading a status from disk) runs in worker threads; waits for
a writer, a group or an upload are awaited holding no thread (:mod:`..snapshot.waiting`), so
any number of ranks waiting never starves the executor; the event loop only converts and
dispatches. The task that returns a snapshot's borrowed segment is tracked, its errors
logged, and :meth:`SnapshotRpcs.drain` awaits it at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from swap_state.proto import swap_state_pb2 as pb

from swap_state.common.errors import (
    FailedPrecondition, InvalidArgument, MetadataBaseUnknown, NoSegment, SnapshotsDisabled,
)
from swap_state.common.snapshot_metadata_parts import MetadataParts, base_id, parse_base, parse_delta
from swap_state.server.observability.metrics import counter, gauge
from swap_state.common.names import parse_snapshot_id
from swap_state.common.snapshot_reader import SnapshotInfo
from swap_state.server.snapshot.restore import restore
from swap_state.server.snapshot.tiers import list_both_tiers
from swap_state.server.logs import log_event
from swap_state.server.memory.arena import Arena
from swap_state.server.memory.session import Session
from swap_state.server.memory.sessions import SessionRegistry
from swap_state.server.snapshot.coordinator import SnapshotCoordinator, RankSnapshot, SnapshotStatus
from swap_state.server.snapshot.source import SnapshotSource
from swap_state.server.tenants import Tenant
from swap_state.server.rpc.validation import (
    validate_job_id_filter,
    validate_session,
    validate_snapshot_id,
    validate_snapshot_rank,
    validate_step,
)

__all__ = [
    "MAX_STATUS_WAIT_S",
    "SnapshotCollector",
    "SnapshotCounters",
    "SnapshotRpcs",
    "snapshot_metrics",
    "status_reply",
]

MAX_STATUS_WAIT_S = 60.0

log = logging.getLogger("swap_state.server.rpc")


_REPLY_FIELDS = tuple(field.name for field in pb.SnapshotStatusReply.DESCRIPTOR.fields)


def status_reply(status: SnapshotStatus) -> pb.SnapshotStatusReply:
    """The protobuf of a status, at the boundary: every reply field from the status field of
    the same name (the state as its string)."""
    values = {name: getattr(status, name) for name in _REPLY_FIELDS}
    values["state"] = status.state.value
    return pb.SnapshotStatusReply(**values)


@dataclasses.dataclass
class SnapshotCounters:
    """Totals over finished snapshot ranks, for the metrics endpoint."""

    started: int = 0
    """Snapshot RPCs that started persisting a rank."""
    durable: int = 0
    """Ranks whose snapshot became durable."""
    failed: int = 0
    """Ranks whose snapshot failed (disk full, I/O error, cancelled)."""
    bytes_persisted: int = 0
    """Bytes written to snapshot files."""
    cow_copies: int = 0
    """Chunks the trainers copied before overwriting them (copy-before-write)."""
    backpressure_waits: int = 0
    """Times a trainer waited for a free copy slot."""
    backpressure_wait_seconds: float = 0.0
    """Seconds trainers spent in those waits."""
    server_staged_chunks: int = 0
    """Chunks the server copied ahead of the trainers (so they did not have to)."""

    def record(self, status: SnapshotStatus) -> None:
        if status.state.value in ("durable", "stored"):
            self.durable += 1
        else:
            self.failed += 1
        self.bytes_persisted += status.bytes_persisted
        self.cow_copies += status.cow_copies
        self.backpressure_waits += status.backpressure_waits
        self.backpressure_wait_seconds += status.backpressure_wait_seconds
        self.server_staged_chunks += status.server_staged_chunks


class SnapshotCollector(Collector):
    """The snapshot families, read from the counters and the coordinator on every scrape."""

    def __init__(self, counters: SnapshotCounters, coordinator: SnapshotCoordinator | None) -> None:
        self.counters = counters
        self.coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        counters = self.counters
        running = self.coordinator.in_progress() if self.coordinator is not None else []
        yield gauge("swap_state_snapshots_in_progress", "Snapshot ranks persisting now.", len(running))
        yield counter("swap_state_snapshots_started_total", "Snapshot ranks started.", counters.started)
        yield counter("swap_state_snapshots_durable_total", "Snapshot ranks made durable.",
                      counters.durable)
        yield counter("swap_state_snapshots_failed_total", "Snapshot ranks that failed.", counters.failed)
        yield counter("swap_state_snapshot_bytes_total", "Bytes persisted by snapshots.",
                      counters.bytes_persisted)
        yield counter("swap_state_snapshot_cow_copies_total",
                      "Chunks copied before write while a snapshot persisted.", counters.cow_copies)
        yield counter("swap_state_snapshot_backpressure_waits_total",
                      "Trainer waits for a free copy-before-write slot.", counters.backpressure_waits)
        yield counter("swap_state_snapshot_backpressure_wait_seconds_total",
                      "Seconds trainers waited for a free copy-before-write slot.",
                      counters.backpressure_wait_seconds)
        uploader = self.coordinator.uploader if self.coordinator is not None else None
        if uploader is not None:
            uploads = uploader.counters
            yield counter("swap_state_store_ranks_stored_total", "Snapshot ranks put in the --snapshot-store.",
                          uploads.ranks_stored)
            yield counter("swap_state_store_ranks_failed_total", "Snapshot ranks whose upload failed.",
                          uploads.ranks_failed)
            yield counter("swap_state_store_bytes_total", "Bytes uploaded to the --snapshot-store.",
                          uploads.bytes_stored)
            yield counter("swap_state_store_upload_seconds_total", "Seconds spent uploading snapshots.",
                          uploads.seconds)


def snapshot_metrics(
    counters: SnapshotCounters, coordinator: SnapshotCoordinator | None
) -> SnapshotCollector:
    """The collector of the snapshot families (an ``extra`` of
    :func:`~swap_state.server.observability.metrics.metrics_registry`)."""
    return SnapshotCollector(counters, coordinator)


class SnapshotRpcs:
    """The snapshot RPCs' work, one method per RPC (the service's boundary wraps them).

    ``snapshots``: the coordinator, or None without --snapshot-dir (every call then fails
    naming the flag)."""

    def __init__(self, registry: SessionRegistry, arena: Arena, snapshots: SnapshotCoordinator | None):
        self.registry = registry
        self.arena = arena
        self.snapshots = snapshots
        self.snapshot_counters = SnapshotCounters()
        self._finishing: set[asyncio.Task[None]] = set()

    def _coordinator(self) -> SnapshotCoordinator:
        if self.snapshots is None:
            raise SnapshotsDisabled(
                "this server keeps no snapshots: start it with --snapshot-dir DIR"
            )
        return self.snapshots

    def _segment_session(self, session_id: str, generation: int, caller: Tenant) -> Session:
        session = self.registry.lookup(session_id, generation)
        caller.check(session.tenant, f"session {session_id} (job {session.job_id!r})")
        if session.segment is None:
            raise NoSegment(
                f"session {session_id} has no segment yet: call Allocate first"
            )
        return session

    async def Snapshot(self, request: pb.SnapshotRequest, context, caller: Tenant) -> pb.SnapshotReply:
        validate_session(request.session_id, request.generation)
        validate_step(request.step)
        coordinator = self._coordinator()
        session = self._segment_session(request.session_id, request.generation, caller)
        async with session.lock:
            if session.last_committed_step != request.step:
                raise FailedPrecondition(
                    f"snapshot of step {request.step} refused: the last committed step of "
                    f"{session.job_id}/rank {session.rank} is {session.last_committed_step}"
                )
            # The writer reads the segment after this reply; borrow() keeps the mapping
            # alive (a detach or grace expiry waits) until the writer lets go.
            with contextlib.ExitStack() as stack:
                parts = await self._metadata_parts(session, request, coordinator.max_metadata_bytes)
                buffer = stack.enter_context(session.segment.borrow())
                source = SnapshotSource(
                    buffer, session.layout, session.header, session.job_id, session.rank,
                    session.world_size, request.step, request.metadata_json, metadata_parts=parts,
                    local_world_size=session.local_world_size,
                    keep_latest=request.keep_latest, keep_all=request.keep_all,
                    replace_existing=request.replace_existing,
                    session_id=session.session_id, generation=session.generation, tenant=session.tenant,
                    bounded_retention=not caller.admin,
                )
                # hold: the writer streams once this reply is sent (the trainer's stall is
                # this RPC; a writer already streaming would compete for the GIL and CPUs).
                handle = await asyncio.to_thread(coordinator.start, source, hold=True)
                held = stack.pop_all()  # started: _finish returns the mapping
        try:
            context.add_done_callback(lambda _context: handle.proceed())
        except Exception:  # no termination callback: let the writer go now
            handle.proceed()
        self.snapshot_counters.started += 1
        task = asyncio.get_running_loop().create_task(_finish(handle, held, self.snapshot_counters))
        self._finishing.add(task)
        task.add_done_callback(self._finished)
        return pb.SnapshotReply(snapshot_id=handle.snapshot_id, consistent=True)

    @staticmethod
    async def _metadata_parts(session: Session, request: pb.SnapshotRequest, max_bytes: int) -> MetadataParts | None:
        """The request's metadata as a base and a delta (None: it sent ``metadata_json``).
        A base sent along is validated and kept with the session; one only named must be
        the one kept (else METADATA_BASE_UNKNOWN: the trainer sends it again)."""
        if not request.metadata_base_id:
            return None
        if request.metadata_json:
            raise InvalidArgument("metadata_json and metadata_base_id exclude each other: send one")
        if request.metadata_base_json:
            if base_id(request.metadata_base_json) != request.metadata_base_id:
                raise InvalidArgument("metadata_base_id is not the digest of metadata_base_json")
            base = await asyncio.to_thread(parse_base, request.metadata_base_json, session.layout.tensors, max_bytes)
            session.metadata_base = (request.metadata_base_id, base)
        held = session.metadata_base
        if held is None or held[0] != request.metadata_base_id:
            raise MetadataBaseUnknown(
                f"this server does not hold the snapshot metadata base {request.metadata_base_id} of "
                f"{session.job_id}/rank {session.rank} (it restarted since the trainer sent it): send it again"
            )
        return parse_delta(request.metadata_delta_json, held[1], max_bytes)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._finishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(log, "snapshot_finish_failed", logging.ERROR, error=repr(task.exception()))

    async def drain(self, timeout_s: float | None = None) -> None:
        """Await the tasks that return borrowed segments (at shutdown, after the coordinator
        has let its writers finish)."""
        if self._finishing:
            await asyncio.wait(set(self._finishing), timeout=timeout_s)

    async def SnapshotStatus(self, request: pb.SnapshotStatusRequest, context,
                             caller: Tenant) -> pb.SnapshotStatusReply:
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

    async def ListSnapshots(self, request: pb.ListSnapshotsRequest, context,
                            caller: Tenant) -> pb.ListSnapshotsReply:
        job_id = validate_job_id_filter(request.job_id)
        coordinator = self._coordinator()
        listed = await asyncio.to_thread(list_both_tiers, coordinator, job_id)
        return pb.ListSnapshotsReply(snapshots=[
            _info_reply(local, stored) for local, stored in listed
            if caller.may_reach((local or stored).index.tenant)  # type: ignore[union-attr]
        ])

    async def Restore(self, request: pb.RestoreRequest, context, caller: Tenant) -> pb.RestoreReply:
        validate_session(request.session_id, request.generation)
        snapshot_id = validate_snapshot_id(request.snapshot_id or "latest", relative=True, latest=True)
        coordinator = self._coordinator()
        session = self._segment_session(request.session_id, request.generation, caller)
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
        return pb.RestoreReply(
            snapshot_id=result.snapshot_id, step=result.step, metadata_json=result.metadata_json,
            source=result.source, snapshot_world_size=result.snapshot_world_size,
            source_ranks=result.source_ranks,
        )


def _info_reply(local: SnapshotInfo | None, stored: SnapshotInfo | None) -> pb.SnapshotInfo:
    """One listed snapshot: its local facts (path, this host's ranks) and where it is in the
    store; ``latest`` as the tier the server would restore ``latest`` from says."""
    first = local or stored
    assert first is not None
    reply = pb.SnapshotInfo(snapshot_id=first.snapshot_id, job_id=first.job_id, step=first.step,
                            world_size=first.world_size, bytes=first.bytes, latest=first.latest,
                            ranks=first.ranks, local_world_size=first.local_world_size)
    if local is not None:
        reply.local, reply.path = True, str(local.path)
    if stored is not None:
        reply.stored, reply.store_path = True, str(stored.path)
    return reply


async def _finish(handle: RankSnapshot, held: contextlib.ExitStack, counters: SnapshotCounters) -> None:
    """Return the borrowed mapping once the writer is done with it, then count the result
    once the group is settled (all its ranks durable, or failed). Awaits without holding a
    thread: a rank may wait minutes for the others of its group."""
    with held:
        await handle.segment_released()
    counters.record(await handle.wait_async())
