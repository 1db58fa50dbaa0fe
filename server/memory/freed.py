"""What the session registry remembers of the sessions it freed, so that a trainer that finds
no state (a fresh Attach, or NOT_FOUND for its old session id) is told when and why it was
freed. Bounded (the last :data:`MAX_FREED` (job id, rank) pairs); used from the registry's loop.
"""

from __future__ import annotations

import collections
import dataclasses

__all__ = ["FreedSession", "FreedSessions", "MAX_FREED"]

#: Freed (job id, rank) pairs remembered; one record is a few hundred bytes.
MAX_FREED = 1024

# Why a session was freed (the registry's reasons, as logged in ``session_freed``), in words.
_WHY = {
    "grace_expired": "no trainer reattached within the server's --grace of {grace:g} s after "
    "the previous one went away",
    "detached": "its trainer detached without keeping it",
    "world_size_changed": "a trainer of the same job and rank attached with another world size",
}


@dataclasses.dataclass(frozen=True)
class FreedSession:
    """One freed session: whose it was, when (the registry's clock) and why."""

    session_id: str
    job_id: str
    rank: int
    reason: str
    freed_at: float
    grace: float
    last_committed_step: int | None

    def describe(self, now: float) -> str:
        """``the server freed the state of job J rank R 12.3 s ago (...): why (reason=...)``."""
        why = _WHY.get(self.reason, "it was freed").format(grace=self.grace)
        step = "" if self.last_committed_step is None else f", last committed step {self.last_committed_step}"
        return (
            f"the server freed the state of job {self.job_id} rank {self.rank} "
            f"{max(0.0, now - self.freed_at):.1f} s ago (session {self.session_id}{step}): "
            f"{why} (reason={self.reason})"
        )


class FreedSessions:
    """The last :data:`MAX_FREED` freed sessions, by (job id, rank)."""

    def __init__(self, limit: int = MAX_FREED) -> None:
        self._limit = limit
        self._by_key: collections.OrderedDict[tuple[str, int], FreedSession] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, freed: FreedSession) -> None:
        key = (freed.job_id, freed.rank)
        self._by_key.pop(key, None)
        self._by_key[key] = freed
        while len(self._by_key) > self._limit:
            self._by_key.popitem(last=False)

    def of(self, job_id: str, rank: int) -> FreedSession | None:
        """The last freed session of (job id, rank), if remembered."""
        return self._by_key.get((job_id, rank))

    def by_id(self, session_id: str) -> FreedSession | None:
        """The freed session of that id, if remembered (only on an error path: a scan)."""
        return next((f for f in self._by_key.values() if f.session_id == session_id), None)
