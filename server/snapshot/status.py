"""What a snapshot reports: :class:`SnapshotState` and :class:`SnapshotStatus`, one rank's view, field for field a
``SnapshotStatusReply`` (made in memory by :meth:`~.group.RankSnapshot.status`, from disk by
:meth:`SnapshotStatus.from_disk`)."""

from __future__ import annotations

import dataclasses
import enum

from swap_state.common.snapshot_format import RankManifest
from swap_state.common.snapshot_tier import SnapshotInfo

__all__ = ["HISTORY", "Recent", "SnapshotState", "SnapshotStatus"]

HISTORY = 256  # snapshots whose upload or replica state stays in memory (older: answered from the tiers)


class Recent(dict):
    """The newest ``HISTORY`` entries, a key set (``recent[key] = value``, the only write) being the newest."""

    def __setitem__(self, key, value) -> None:
        self.pop(key, None)  # re-inserted last (dicts keep insertion order)
        super().__setitem__(key, value)
        while len(self) > HISTORY:
            del self[next(iter(self))]


class SnapshotState(str, enum.Enum):
    """The protocol's state strings (``SnapshotStatusReply.state``)."""

    PERSISTING = "persisting"
    DURABLE = "durable"
    STORED = "stored"  # durable, and every file of the rank is in the ``--snapshot-store`` too
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class SnapshotStatus:
    """One rank's view of a snapshot; field for field a SnapshotStatusReply (the proto says each)."""

    snapshot_id: str
    job_id: str
    step: int
    rank: int
    world_size: int  # the job's (global) world size
    state: SnapshotState
    bytes_total: int  # tensor bytes of this rank
    bytes_persisted: int
    error: str  # why it failed (empty unless failed)
    cow_copies: int  # chunks the trainer copied before writing, during this snapshot (this rank)
    backpressure_waits: int  # times the trainer waited for a free copy slot, likewise
    backpressure_wait_seconds: float
    path: str  # the snapshot directory (the partial one until durable)
    ranks_joined: int
    ranks_persisted: int  # ranks whose files are written and fsynced
    segment_released: bool  # whether the server is done reading this rank's segment
    warnings: tuple[str, ...] = ()  # problems after the commit (latest pointer, retention): not a failure
    local_world_size: int = 0  # ranks that must be durable on this server before the snapshot is (0: ``world_size``)
    ranks: tuple[int, ...] = ()  # the ranks that have joined (in memory) or that the durable snapshot holds (from disk)
    server_staged_chunks: int = 0  # this and trainer_copied_bytes: 0 from disk
    server_staged_bytes: int = 0
    trainer_copied_bytes: int = 0
    store_state: str = ""
    store_error: str = ""
    store_path: str = ""
    bytes_stored: int = 0
    replica_state: str = ""
    replica_peer: str = ""
    replica_error: str = ""

    @classmethod
    def from_disk(cls, info: SnapshotInfo, manifest: RankManifest) -> "SnapshotStatus":
        """A durable snapshot no longer in memory, as its index and the rank's manifest say."""
        total = sum(t.nbytes for t in manifest.tensors)
        return cls(snapshot_id=info.snapshot_id, job_id=info.job_id, step=info.step, rank=manifest.rank,
                   world_size=info.world_size, state=SnapshotState.DURABLE, bytes_total=total, bytes_persisted=total,
                   error="", cow_copies=manifest.cow_copies, backpressure_waits=manifest.backpressure_waits,
                   backpressure_wait_seconds=manifest.backpressure_wait_seconds, path=str(info.path),
                   ranks_joined=info.local_world_size, ranks_persisted=info.local_world_size, segment_released=True,
                   local_world_size=info.local_world_size, ranks=info.ranks)
