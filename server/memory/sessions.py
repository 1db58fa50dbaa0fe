"""Sessions: one per (job id, rank), with a generation number and stream-based liveness.

Lifecycle::

    Attach ──> pending ──KeepAlive stream opens──> live ──stream closes──> orphaned
                  │                                  ▲                       │
                  └── no stream within stream_wait ──┼──> orphaned ──grace──> freed
                                                     └── reattach / stream reopened

Liveness is the KeepAlive stream being open, nothing else. An orphaned session keeps its segment
for ``grace`` seconds; the same (job, rank) attaching in time gets it back with a new generation
(an older generation's calls fail FAILED_PRECONDITION). A live session is never taken over. An
adopted session begins orphaned. Used from one asyncio loop; blocking arena work runs in threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence

from swap_state.common.errors import (
    SERVER_STOPPING_NOTICE, LayoutMismatchError, NotFoundError, SessionLiveError, StaleGenerationError,
    ServerUnavailableError)
from swap_state.common import trainer_presence
from swap_state.common.segment import TensorSpec, layout_hash
from swap_state.common.segment_descriptor import SegmentDescriptor
from swap_state.server.logs import log_event
from swap_state.server.memory.adopt import Adopted
from swap_state.server.memory.arena import Arena, Segment
from swap_state.server.memory.session import FreedSession, LivenessStream, Session, SessionState
from swap_state.server.tenants import ANYONE, Tenant

__all__ = ["SessionRegistry"]

log = logging.getLogger(__name__)

MAX_FREED = 1024  # freed (job id, rank) pairs remembered; one record is a few hundred bytes


class SessionRegistry:
    """All sessions of the server, with the reaper that frees expired orphans."""

    def __init__(self, arena: Arena, *, grace: float, stream_wait: float, max_tensors: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.arena, self.grace, self.stream_wait, self.max_tensors = arena, grace, stream_wait, max_tensors
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[tuple[str, int], Session] = {}
        self._shutting_down = False
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[tuple[Segment, bool]]] = set()
        self._retired_commits = self._retired_drops = 0  # of freed sessions
        # Counters for Stats and the metrics (whose help texts say what each counts).
        self.attaches = self.reattaches = self.sessions_freed = self.sessions_expired = 0
        self.sessions_adopted = self.reconnects = 0
        # The last MAX_FREED sessions freed, by (job id, rank): why a trainer finds no state.
        self._freed: collections.OrderedDict[tuple[str, int], FreedSession] = collections.OrderedDict()

    @property
    def steps_committed_total(self) -> int:
        """Steps committed, all sessions, freed ones included (read from the headers)."""
        return self._retired_commits + sum(s.steps_committed for s in self._sessions.values())

    @property
    def kept_states_dropped_total(self) -> int:
        """Reattached states trainers dropped, all sessions, freed ones included."""
        return self._retired_drops + sum(s.kept_states_dropped for s in self._sessions.values())

    @property
    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def lookup(self, session_id: str, generation: int) -> Session:
        """The session, if ``generation`` is its current one (else FAILED_PRECONDITION)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise self._not_found(session_id, f"no session {session_id} on this server (never attached, "
                                  "detached, or freed after its grace period): Attach again")
        self._check_generation(session, generation)
        return session

    def why_no_state(self, job_id: str, rank: int) -> str:
        """Why this server holds no state for (job_id, rank) if it freed it, else ""."""
        freed = self._freed.get((job_id, rank))
        return freed.describe(self._clock()) if freed is not None else ""

    def _not_found(self, session_id: str, otherwise: str) -> NotFoundError:
        """Why ``session_id`` is gone, when this registry freed it; else ``otherwise``."""
        freed = next((f for f in self._freed.values() if f.session_id == session_id), None)  # errors only
        if freed is None:
            return NotFoundError(otherwise)
        grace = "; a longer --grace keeps a vanished trainer's state longer" if freed.reason == "grace_expired" else ""
        return NotFoundError(f"{freed.describe(self._clock())}. Its optimizer state is gone: Attach again and "
                        f"restore a snapshot (or load a checkpoint){grace}")

    def _check_generation(self, session: Session, generation: int) -> None:
        if session.closed:
            raise self._not_found(session.session_id, f"session {session.session_id} was freed: Attach again")
        if generation > session.generation:
            raise StaleGenerationError(f"generation {generation} was never issued for job {session.job_id} rank "
                                  f"{session.rank} (current: {session.generation})")
        if generation != session.generation:
            raise StaleGenerationError(f"stale generation {generation} for job {session.job_id} rank {session.rank}: "
                                  f"the session was re-attached as generation {session.generation}")

    def orphaned_seconds(self, session: Session) -> float:
        if session.state is not SessionState.ORPHANED or session.orphaned_since is None:
            return 0.0
        return max(0.0, self._clock() - session.orphaned_since)

    async def attach(self, job_id: str, rank: int, world_size: int, *, local_world_size: int, client_pid: int = 0,
                     client_host: str = "", tenant: Tenant = ANYONE) -> tuple[Session, bool]:
        """Open or re-open the session of (job_id, rank) for ``tenant`` (who may claim the job:
        :mod:`swap_state.server.domain` decides): (session, reattached)."""
        self._check_open()
        session = self._by_key.get((job_id, rank))
        reattached = False
        if session is not None:
            self._refuse_if_live(session)
            async with session.lock:  # waits for an in-flight Allocate of the old generation
                reattached = await self._reattach(session, world_size, local_world_size)
        if reattached:
            self.reattaches += 1
        else:
            session = Session(session_id=secrets.token_hex(16), job_id=job_id, rank=rank, world_size=world_size,
                              generation=1, local_world_size=local_world_size, tenant=tenant.name)
            self._sessions[session.session_id] = session
            self._by_key[(job_id, rank)] = session
        session.client_pid, session.client_host = client_pid, client_host
        session.state = SessionState.PENDING
        session.orphaned_since = None
        session.stream_deadline = self._clock() + self.stream_wait
        self.attaches += 1
        log_event(log, "session_attached", **session._describe(), world_size=world_size,
                  local_world_size=local_world_size, reattached=reattached, client_pid=client_pid,
                  client_host=client_host, has_segment=session.segment is not None)
        return session, reattached

    async def _reattach(self, existing: Session, world_size: int, local_world_size: int) -> bool:
        """Under ``existing.lock``: give the kept session a new generation (True), or free it
        when the job's world size changed (False: the caller opens a fresh session)."""
        self._check_open()
        self._refuse_if_live(existing)
        if existing.closed:
            return False
        if existing.world_size != world_size or existing.local_world_size != local_world_size:
            log_event(log, "session_replaced", logging.WARNING, **existing._describe(),
                      old_world_size=existing.world_size, new_world_size=world_size,
                      old_local_world_size=existing.local_world_size, new_local_world_size=local_world_size,
                      detail="world size changed; the kept segment does not fit the new job")
            await self._remove(existing, "world_size_changed")
            return False
        existing.generation += 1
        existing.rewind_allowed = True
        return True

    def _check_open(self) -> None:
        if self._shutting_down:
            raise ServerUnavailableError("the server is shutting down")

    def _refuse_if_live(self, session: Session) -> None:
        # An adopted session whose trainer still maps its segment: that trainer reconnects.
        if (session.awaiting_reconnect and not session.closed and session.segment is not None
                and trainer_presence.held(session.segment.path)):
            left = max(0.0, self.grace - self.orphaned_seconds(session))
            raise SessionLiveError(
                f"job {session.job_id} rank {session.rank} was live when the previous server stopped, and its trainer "
                "process still maps its segment: this server adopted its state and keeps it for that trainer, which "
                f"reconnects by itself, for another {left:.0f} s (--grace). Another trainer of this job id and rank "
                "can attach once that one has ended; to run beside it, use another job id")
        if session.state is SessionState.LIVE and not session.closed:
            raise SessionLiveError(
                f"job {session.job_id} rank {session.rank} is attached and live (client pid {session.client_pid} on "
                f"{session.client_host or '?'}, generation {session.generation}): another trainer with the same job "
                "id and rank? Stop that trainer first, or give this one another job id")

    def adopt(self, adopted: Adopted) -> None:
        """A session rebuilt from a previous server's segment, orphaned until its trainer's stream is back."""
        d = adopted.descriptor
        session = Session(session_id=adopted.session_id, job_id=d.job_id, rank=d.rank, world_size=d.world_size,
                          generation=adopted.generation, local_world_size=d.local_world_size, tenant=d.tenant,
                          segment=adopted.segment, adopted=True, streamed_generation=adopted.generation,
                          awaiting_reconnect=True)
        self._sessions[session.session_id] = session
        self._by_key[(session.job_id, session.rank)] = session
        self.sessions_adopted += 1
        self._orphan(session, "adopted")
        log_event(log, "session_adopted", **session._describe(), path=adopted.segment.path,
                  bytes=adopted.segment.file_bytes, last_committed_step=session.last_committed_step,
                  closed_snapshot_epoch=adopted.open_epoch)

    async def detach(self, session: Session, generation: int, *, keep: bool) -> None:
        async with session.lock:
            self._check_generation(session, generation)
            self._end_streams(session, "detached")
            if keep:
                self._orphan(session, "detached_keep")
            else:
                await self._remove(session, "detached")

    def open_stream(self, session: Session, generation: int) -> LivenessStream:
        """Register a KeepAlive stream of the :meth:`lookup`'d session: live until it closes."""
        self._check_open()
        stream = LivenessStream(session, generation)
        session.streams.add(stream)
        if session.streamed_generation == generation and session.state is not SessionState.LIVE:
            self.reconnects += 1  # the same trainer, back without an Attach
            log_event(log, "session_reconnected", **session._describe(), adopted=session.adopted)
        session.streamed_generation = generation
        session.awaiting_reconnect = False
        if session.state is not SessionState.LIVE:
            session.state = SessionState.LIVE
            session.orphaned_since = None
            session.stream_deadline = None
            log_event(log, "session_live", **session._describe())
        return stream

    def close_stream(self, stream: LivenessStream) -> None:
        """The stream ended (client gone, cancelled, or ended by the server)."""
        session = stream.session
        session.streams.discard(stream)
        if session.closed or stream.generation != session.generation:
            return
        if session.state is SessionState.LIVE and not any(s.generation == session.generation for s in session.streams):
            self._orphan(session, stream.end_reason or "stream_closed")

    def _orphan(self, session: Session, reason: str) -> None:
        session.state = SessionState.ORPHANED
        session.orphaned_since = self._clock()
        session.stream_deadline = None
        log_event(log, "session_orphaned", **session._describe(), reason=reason,
                  grace_seconds=self.grace, has_segment=session.segment is not None)

    @staticmethod
    def _end_streams(session: Session, reason: str) -> None:
        for stream in list(session.streams):
            stream.end(reason)

    async def allocate(self, session: Session, generation: int, checked: Sequence[TensorSpec]) -> tuple[Segment, bool]:
        """Create the session's segment of ``checked`` tensors: (segment, reused). Idempotent
        for the same layout (a reattached trainer gets its bytes back); another is refused."""
        # Hashing is O(tensors) Python: off the loop, like the page faulting.
        wanted_hash = await asyncio.to_thread(layout_hash, checked)
        # Shielded: a creation the caller gave up on still lands in the session, so a retry
        # gets reused=True and no committed bytes are left without an owner.
        task = asyncio.get_running_loop().create_task(self._allocate_locked(session, generation, checked, wanted_hash))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await asyncio.shield(task)

    async def _allocate_locked(self, session: Session, generation: int, checked: list[TensorSpec],
                               wanted_hash: str) -> tuple[Segment, bool]:
        async with session.lock:
            self._check_open()
            self._check_generation(session, generation)
            if session.segment is not None:
                if session.segment.layout_hash == wanted_hash:
                    return session.segment, True
                raise LayoutMismatchError(f"job {session.job_id} rank {session.rank} already has a segment with another "
                                     f"layout (hash {session.segment.layout_hash[:12]}, requested "
                                     f"{wanted_hash[:12]}): Detach with keep=false, then Attach and Allocate again")
            started = time.perf_counter()
            log_event(log, "segment_allocating", **session._describe(), tensors=len(checked))
            descriptor = SegmentDescriptor(session.job_id, session.rank, session.world_size,
                                           session.local_world_size, tuple(checked), wanted_hash, session.tenant)
            segment = await asyncio.to_thread(self.arena.create_segment, session.session_id, descriptor)
            session.segment = segment
            log_event(log, "segment_allocated", **session._describe(), path=segment.path, bytes=segment.size,
                      tensors=len(checked), chunks=segment.layout.n_chunks, cow_slots=segment.cow_slots,
                      mlocked=segment.locked, seconds=round(time.perf_counter() - started, 3),
                      budget_free=self.arena.free_bytes)
            return segment, False

    @staticmethod
    def commit_step(session: Session, step: int) -> int:
        """Record ``step`` as committed (its moments are completely in the segment)."""
        if session.record_commit(step):
            log_event(log, "step_committed", logging.DEBUG, **session._describe(), step=step)
        return step

    async def _remove(self, session: Session, reason: str) -> None:
        session.closed = True
        self._end_streams(session, reason)
        self._sessions.pop(session.session_id, None)
        key = (session.job_id, session.rank)
        if self._by_key.get(key) is session:
            del self._by_key[key]
        self._retired_commits += session.steps_committed
        self._retired_drops += session.kept_states_dropped
        if reason != "shutdown":
            self._freed.pop(key, None)
            self._freed[key] = FreedSession(session.session_id, session.job_id, session.rank, reason,
                                            self._clock(), self.grace, session.last_committed_step)
            while len(self._freed) > MAX_FREED:
                self._freed.popitem(last=False)
        segment, session.segment = session.segment, None
        freed = segment.size if segment is not None else 0
        if segment is not None:
            # Returning a big tmpfs file's pages takes seconds for tens of GiB: off the loop.
            await asyncio.to_thread(self.arena.free, segment)
        self.sessions_freed += 1
        log_event(log, "session_freed", **session._describe(), reason=reason, bytes=freed,
                  budget_used=self.arena.used_bytes)

    async def reap(self) -> None:
        """Orphan pending sessions past their stream deadline; free orphans past the grace."""
        now = self._clock()
        for session in list(self._sessions.values()):
            deadline = session.stream_deadline
            if session.state is SessionState.PENDING and deadline is not None and now >= deadline:
                self._orphan(session, "no_keepalive_stream")
                session.orphaned_since = deadline  # the grace period runs from the deadline
            since = session.orphaned_since
            if (session.state is SessionState.ORPHANED and since is not None and now - since >= self.grace
                    and not session.lock.locked()  # an RPC is working on it; next round
                    and not session.closed):
                self.sessions_expired += 1
                await self._remove(session, "grace_expired")

    async def _reap_forever(self) -> None:
        interval = min(0.5, max(0.02, min(self.grace, self.stream_wait) / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap()
            except Exception:  # the reaper must survive anything; log and go on
                log_event(log, "reaper_error", logging.ERROR, exc_info=True)

    def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="swap-state-reaper")

    def begin_shutdown(self) -> None:
        """Refuse new attaches and streams; end every KeepAlive stream with a notice."""
        self._shutting_down = True
        for session in self._sessions.values():
            self._end_streams(session, SERVER_STOPPING_NOTICE)

    async def close(self, keep_segments: bool = False) -> None:
        """Stop the reaper and end every session (shutdown); with ``keep_segments`` the segment files of
        the sessions not freed stay for the next server to adopt."""
        self.begin_shutdown()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        kept = []
        for session in list(self._sessions.values()):
            async with session.lock:  # lets an in-flight Allocate finish first
                if keep_segments and session.segment is not None and not session.closed:
                    kept.append(session.segment)
                    log_event(log, "session_kept", **session._describe(), path=session.segment.path,
                              bytes=session.segment.file_bytes)
                elif not session.closed:
                    await self._remove(session, "shutdown")
        await asyncio.to_thread(self.arena.close, kept)
