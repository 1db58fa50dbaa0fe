"""Each durable local snapshot copied into a peer server's memory (``--replica-peers``) by one
worker thread through the replica tier (:class:`~.replica.ReplicaTier`), every file's crc32
checked on the way and again by the peer; only the newest queued snapshot of a job is sent
(a lost host needs the newest). A failing peer fails the rank's ``replica_state``, never the
snapshot: it stays durable. Call order: ``SnapshotReplicator(...)`` at start, ``submit`` after
each local commit, ``annotate`` / ``wait_async`` from the RPCs, ``close`` at shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from swap_state.common.snapshot_errors import SnapshotError
from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.server.logs import log_event
from swap_state.server.snapshot.status import SnapshotStatus
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.replica import ReplicaTier
from swap_state.server.snapshot.tiers.seam import StepPlan, copy_rank
from swap_state.server.snapshot.waiting import WatchedCondition
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter

__all__ = ["ReplicaState", "SnapshotReplicator"]

log = logging.getLogger(__name__)

HISTORY = 256  # snapshots whose replica state stays in memory


@dataclasses.dataclass
class ReplicaState:
    """One snapshot's replica (every rank of this host goes in one step)."""

    state: str = "replicating"  # then "replicated" or "failed"
    peer: str = ""  # where the replica is (the peer's address and directory) once replicated
    error: str = ""


class SnapshotReplicator:
    """Replicates durable local snapshots into a peer's memory, one worker thread."""

    def __init__(self, tier: ReplicaTier, local: SnapshotDirectory, max_bandwidth: float | None = None):
        self._tier, self._local = tier, local
        self._limiter = BandwidthLimiter(max_bandwidth)
        self._queue: queue.Queue[SnapshotInfo | None] = queue.Queue()
        self._states: dict[tuple[str, int], ReplicaState] = {}
        self._cond = WatchedCondition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._work, name="snapshot-replicate", daemon=True)
        self._thread.start()

    def submit(self, info: SnapshotInfo) -> None:
        with self._cond:
            self._states[(info.job_id, info.step)] = ReplicaState()
            while len(self._states) > HISTORY:
                del self._states[next(iter(self._states))]
            self._cond.notify_all()
        self._queue.put(info)

    def state(self, job_id: str, step: int) -> ReplicaState | None:
        with self._cond:
            found = self._states.get((job_id, step))
            return dataclasses.replace(found) if found is not None else None

    async def wait_async(self, job_id: str, step: int, timeout_s: float) -> None:
        """Until the snapshot's replica is settled (replicated or failed), at most ``timeout_s``."""
        def settled() -> bool:
            found = self._states.get((job_id, step))
            return found is None or found.state != "replicating"

        await self._cond.until(settled, timeout_s)

    def annotate(self, status: SnapshotStatus) -> SnapshotStatus:
        """A durable rank's status with its replica's fields (none for a snapshot not sent here)."""
        found = self.state(status.job_id, status.step)
        if found is None:
            return status
        return dataclasses.replace(status, replica_state=found.state, replica_peer=found.peer,
                                   replica_error=found.error)

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        self._tier.close()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _work(self) -> None:
        while not self._closed.is_set():
            info = self._queue.get()
            if info is None:
                return
            newer = self._newest_queued(info)
            for skipped in newer[:-1]:
                self._settle(skipped, "failed", error=f"not replicated: {newer[-1].snapshot_id} came before "
                                                       "its turn, and only the newest of a job is sent")
            self._replicate(newer[-1])

    def _newest_queued(self, info: SnapshotInfo) -> list[SnapshotInfo]:
        """``info`` and the queued snapshots of its job after it, oldest first; other jobs' keep their places."""
        mine, others = [info], []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            (mine if item is not None and item.job_id == info.job_id else others).append(item)
        for item in others:
            self._queue.put(item)
        return sorted(mine, key=lambda found: found.step)

    def _replicate(self, info: SnapshotInfo) -> None:
        begin, index = time.monotonic(), info.index
        plan = StepPlan(info.job_id, info.step, info.world_size, info.ranks, index.tenant, None, replace=True,
                        source=index)
        try:
            target = self._tier.prepare(plan)
            try:
                for rank in target.ranks:
                    copy_rank(self._local.reader, info, rank, self._tier, target, self._limiter, self._closed,
                              lambda size: None)
                layout = self._local.reader.read_layout(info) if index.layout is not None else None
                result = self._tier.finish(target, index, layout)
            except BaseException:
                self._tier.discard(target)
                raise
        except (OSError, SnapshotError) as exc:
            log_event(log, "snapshot_replica_failed", logging.ERROR, snapshot_id=info.snapshot_id,
                      peers=self._tier.root, error=str(exc))
            self._settle(info, "failed", error=f"replicating {info.snapshot_id} to {self._tier.root} failed: {exc}. "
                                                "It stays durable here; check the peers (--replica-peers)")
            return
        seconds = time.monotonic() - begin
        log_event(log, "snapshot_replicated", snapshot_id=info.snapshot_id, peer=str(result.path),
                  bytes=info.bytes, seconds=round(seconds, 3))
        self._settle(info, "replicated", peer=str(result.path))

    def _settle(self, info: SnapshotInfo, state: str, peer: str = "", error: str = "") -> None:
        with self._cond:
            self._states[(info.job_id, info.step)] = ReplicaState(state, peer, error)
            self._cond.notify_all()
