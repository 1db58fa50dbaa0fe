"""Protobuf replies of the domain's values, built at the boundary by the servicer (:mod:`.service`)."""

from __future__ import annotations

from typing import Any, TypeVar

from swap_state.proto import swap_state_pb2 as pb

from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.server.snapshot.status import SnapshotStatus

__all__ = ["info_reply", "reply_of", "status_reply"]

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
