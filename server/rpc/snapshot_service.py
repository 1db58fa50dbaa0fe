"""The snapshot RPCs' helpers: protobuf replies of the snapshot domain and the task that
returns a snapshot's borrowed segment (:func:`finish_snapshot`, tracked by the servicer,
:mod:`.service`).
"""

from __future__ import annotations

import asyncio
import contextlib

from swap_state.proto import swap_state_pb2 as pb

from swap_state.common.errors import InvalidArgument, MetadataBaseUnknown
from swap_state.common.snapshot_metadata_parts import MetadataParts, base_id, parse_base, parse_delta
from swap_state.common.snapshot_reader import SnapshotInfo
from swap_state.server.observability.metrics import SnapshotCounters
from swap_state.server.memory.session import Session
from swap_state.server.snapshot.coordinator import RankSnapshot, SnapshotStatus

__all__ = ["MAX_STATUS_WAIT_S", "finish_snapshot", "info_reply", "metadata_parts", "status_reply"]

MAX_STATUS_WAIT_S = 60.0

_REPLY_FIELDS = tuple(field.name for field in pb.SnapshotStatusReply.DESCRIPTOR.fields)


def status_reply(status: SnapshotStatus) -> pb.SnapshotStatusReply:
    """The protobuf of a status, at the boundary: every reply field from the status field of
    the same name (the state as its string)."""
    values = {name: getattr(status, name) for name in _REPLY_FIELDS}
    values["state"] = status.state.value
    return pb.SnapshotStatusReply(**values)


async def metadata_parts(session: Session, request: pb.SnapshotRequest, max_bytes: int) -> MetadataParts | None:
    """A Snapshot request's metadata as a base and a delta (None: it sent ``metadata_json``,
    which stays for a trainer whose client predates the base and delta while its host's server
    is upgraded under it). A base sent along is validated and kept with the session; one only named must be the one
    kept (else METADATA_BASE_UNKNOWN: the trainer sends it again)."""
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


def info_reply(local: SnapshotInfo | None, stored: SnapshotInfo | None) -> pb.SnapshotInfo:
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


async def finish_snapshot(handle: RankSnapshot, held: contextlib.ExitStack, counters: SnapshotCounters) -> None:
    """Return the borrowed mapping once the writer is done with it, then count the result
    once the group is settled (all its ranks durable, or failed). Awaits without holding a
    thread: a rank may wait minutes for the others of its group."""
    with held:
        await handle.segment_released.wait_async()
    counters.record(await handle.wait_async())
