"""One trainer rank's session as the server holds it (:class:`Session`, its :class:`SessionState`, the
:class:`LivenessStream` that keeps it live), and :class:`FreedSession`, what the registry remembers of one it freed, so
a trainer that finds no state is told when and why."""

from __future__ import annotations

import asyncio
import dataclasses
import enum

from swap_state.common.errors import FailedPreconditionError, NoSegmentError
from swap_state.common.segment import SegmentHeader, SegmentLayout, Word, committed_step
from swap_state.common.server_header import ServerHeader
from swap_state.common.snapshot_metadata_parts import MetadataBase
from swap_state.server.memory.arena import Segment

__all__ = ["FreedSession", "LivenessStream", "Session", "SessionState"]


class SessionState(str, enum.Enum):
    PENDING = "pending"  # attached, KeepAlive stream not open yet
    LIVE = "live"  # a KeepAlive stream of the current generation is open
    ORPHANED = "orphaned"  # kept for the grace period, then freed


class LivenessStream:
    """One open KeepAlive stream; the server ends it by calling :meth:`end`."""

    def __init__(self, session: Session, generation: int) -> None:
        self.session, self.generation = session, generation
        self.end_reason: str | None = None
        self._ended = asyncio.Event()

    def end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
            self._ended.set()

    async def wait_end(self, timeout: float) -> str | None:
        """The end reason, or None when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._ended.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return self.end_reason


@dataclasses.dataclass(eq=False)
class Session:
    """One trainer rank's state on this host; :meth:`record_commit` commits a step through the server."""

    session_id: str
    job_id: str
    rank: int
    world_size: int  # the job's (global) world size
    generation: int
    local_world_size: int  # ranks of the job on this server; a snapshot here needs them all
    client_pid: int = 0
    client_host: str = ""
    tenant: str = ""  # only its calls, or an admin's, reach the session
    segment: Segment | None = None
    rpc_commits: int = 0  # steps committed through the CommitStep RPC (trainers commit through the header)
    state: SessionState = SessionState.PENDING
    orphaned_since: float | None = None  # monotonic time it became orphaned
    stream_deadline: float | None = None  # monotonic time by which a pending session must open its stream
    rewind_allowed: bool = False  # after a reattach the trainer may commit an earlier step once (a restore)
    closed: bool = False  # removed from the registry (its segment freed or being freed)
    metadata_base: tuple[str, MetadataBase] | None = None  # (id, parsed base) the trainer sent last; memory only
    adopted: bool = False  # rebuilt from a previous server's segment at this server's start
    awaiting_reconnect: bool = False
    """Adopted, its trainer not back yet: while that trainer still maps the segment, only it
    takes the session back (a fresh Attach is refused)."""
    streamed_generation: int = 0  # the generation whose KeepAlive stream was last opened (0: none)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock, repr=False)
    streams: set[LivenessStream] = dataclasses.field(default_factory=set, repr=False)

    @property
    def layout(self) -> SegmentLayout | None:
        return self.segment.layout if self.segment else None

    @property
    def header(self) -> SegmentHeader | None:
        return self.segment.header if self.segment else None

    @property
    def last_committed_step(self) -> int | None:
        """The last committed step the segment's header holds (None: none yet)."""
        return committed_step(self.header) if self.header is not None else None

    @property
    def kept_states_dropped(self) -> int:
        """Reattached states the trainer dropped (not its parameters' state; header word)."""
        return self.header[Word.STATE_DROPS] if self.header is not None else 0

    @property
    def steps_committed(self) -> int:
        """Steps committed to this session's segment, through the header or the RPC."""
        return self.rpc_commits + (self.header[Word.TRAINER_COMMITS] if self.header is not None else 0)

    def record_commit(self, step: int, *, force: bool = False) -> bool:
        """Record a committed step in the header; False for a repeat of the last (a retry).
        Going backwards needs ``force`` (restore) or the one-time allowance after a reattach."""
        if self.segment is None or self.segment.header is None:
            raise NoSegmentError(f"session {self.session_id} has no segment: call Allocate before CommitStep")
        last = self.last_committed_step
        if last is not None and step < last and not (force or self.rewind_allowed):
            raise FailedPreconditionError(
                f"step {step} goes backwards: step {last} is already committed for job "
                f"{self.job_id} rank {self.rank} (an earlier step is accepted once after a reattach)")
        self.rewind_allowed = False
        if step == last:
            return False
        ServerHeader(self.segment.header).record_commit(step)  # the server's value holds now
        self.rpc_commits += 1
        return True

    def _describe(self) -> dict[str, object]:
        return {"session_id": self.session_id, "job_id": self.job_id, "rank": self.rank,
                "generation": self.generation, **({"tenant": self.tenant} if self.tenant else {})}


# Why a session was freed (the registry's reasons, as logged in ``session_freed``), in words.
_WHY = {
    "grace_expired": "no trainer reattached within the server's --grace of {grace:g} s after "
    "the previous one went away",
    "detached": "its trainer detached without keeping it",
    "world_size_changed": "a trainer of the same job and rank attached with another world size"}


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
        return (f"the server freed the state of job {self.job_id} rank {self.rank} {max(0.0, now - self.freed_at):.1f} "
                f"s ago (session {self.session_id}{step}): {why} (reason={self.reason})")
