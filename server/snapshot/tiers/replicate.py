"""The replica state of each snapshot this server sends to a peer (``--replica-peers``): ``replicating`` from its start,
then ``replicated`` (where) or ``failed`` (why), as :class:`~.mirror.MirroredTier` settles it. The RPCs read it
(``annotate``) and wait for it (``wait_async``); only the newest ``HISTORY`` stay in memory.
"""

from __future__ import annotations

import collections
import dataclasses

from swap_state.server.snapshot.status import Recent, SnapshotStatus
from swap_state.server.snapshot.waiting import WatchedCondition

__all__ = ["ReplicaState", "ReplicaStates"]


@dataclasses.dataclass
class ReplicaState:
    """One snapshot's replica (every rank of this host goes in one step)."""

    state: str = "replicating"  # then "replicated" or "failed"
    peer: str = ""  # where the replica is (the peer's address and directory) once replicated
    error: str = ""


class ReplicaStates:
    """The replica states of this server's snapshots, by (job, step). Thread-safe."""

    def __init__(self) -> None:
        self._states: Recent[tuple[str, int], ReplicaState] = Recent()
        self._cond = WatchedCondition()
        self.counters: collections.Counter[str] = collections.Counter()  # "replicated", "failed", "bytes" (metrics)

    def settle(self, job_id: str, step: int, state: str, peer: str = "", error: str = "", nbytes: int = 0) -> None:
        """``nbytes``: of a replicated step, for the metrics."""
        with self._cond:
            if state != "replicating":
                self.counters[state] += 1
                self.counters["bytes"] += nbytes
            self._states[(job_id, step)] = ReplicaState(state, peer, error)
            self._cond.notify_all()

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
