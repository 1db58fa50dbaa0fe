"""A step written into two tiers at once: :class:`MirroredTier` writes every byte into its primary tier (the
``--snapshot-dir``: its commit rule decides the step) and, while the disk persists, sends it to a peer's memory (the
replica tier, ``--replica-peers``): the writer reads the segment once, one crc32 serves both. The mirror is a best
effort: its failure (the peer down, full, killed mid-step) is recorded in the step's replica state, never raised, and
the step stays durable here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from swap_state.common.snapshot_errors import SnapshotError
from swap_state.common.snapshot_format import FileRecord, SnapshotIndex
from swap_state.server.logs import log_event
from swap_state.server.snapshot.tiers.replica import ReplicaTier, SendingSink
from swap_state.server.snapshot.tiers.replica_wire import DATA_FRAME_BYTES
from swap_state.server.snapshot.tiers.replicate import ReplicaStates
from swap_state.server.snapshot.tiers.seam import CommitResult, StepPlan, StepWrite, TierWriter
from swap_state.server.snapshot.writing.sink import ChunkSink

__all__ = ["MirroredTier"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass
class _Mirror:
    """A step's copy on the peer: prepared by the first rank that writes, failed at most once."""

    plan: StepPlan
    target: StepWrite | None = None
    error: str = ""
    began: float = dataclasses.field(default_factory=time.monotonic)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class MirroredTier(TierWriter):
    """``primary``'s steps, each mirrored into ``mirror`` as it is written (the seam's call order)."""

    def __init__(self, primary: TierWriter, mirror: ReplicaTier, states: ReplicaStates):
        self.primary, self.mirror, self.states = primary, mirror, states
        self.root = primary.root
        self._mirrors: dict[str, _Mirror] = {}
        self._lock = threading.Lock()

    def prepare(self, plan: StepPlan) -> StepWrite:
        """The primary's place; the peer is asked by the first rank that writes (not in the RPC)."""
        target = self.primary.prepare(plan)
        with self._lock:
            self._mirrors[str(target.location)] = _Mirror(dataclasses.replace(plan, replace=True))
        self.states.settle(plan.job_id, plan.step, "replicating")
        return target

    def open_file(self, target: StepWrite, name: str) -> ChunkSink:
        """The primary's file now, the peer's with the first bytes: a lost peer takes seconds to give up on, and a
        memory-only snapshot's stager starts copying once this returns."""
        with self._lock:
            mirror = self._mirrors[str(target.location)]
        return _TeeSink(self.primary.open_file(target, name),
                        lambda: self._try(self._mirror(target), lambda on: self.mirror.open_file(on, name)),
                        lambda exc: self._fail(mirror, exc))

    def write_file(self, target: StepWrite, name: str, data: bytes) -> None:
        self.primary.write_file(target, name, data)
        self._try(self._mirror(target), lambda on: self.mirror.write_file(on, name, data))

    def finish_rank(self, target: StepWrite, rank: int, files: tuple[FileRecord, ...]) -> None:
        self.primary.finish_rank(target, rank, files)
        self._try(self._mirror(target), lambda on: self.mirror.finish_rank(on, rank, files))

    def finish(self, target: StepWrite, index: SnapshotIndex, layout: bytes | None) -> CommitResult:
        """The primary's commit, then the peer's (its outcome is the step's replica state)."""
        result = self.primary.finish(target, index, layout)
        mirror = self._forget(target)
        if mirror is None:
            return result
        replicated = self._try(mirror, lambda on: self.mirror.finish(on, index, layout))
        if replicated is None:
            if mirror.target is not None:
                self.mirror.discard(mirror.target)
            log_event(log, "snapshot_replica_failed", logging.ERROR, snapshot_id=index.snapshot_id,
                      peers=self.mirror.root, error=mirror.error)
            self.states.settle(index.job_id, index.step, "failed",
                               error=f"replicating {index.snapshot_id} to {self.mirror.root} failed: {mirror.error}. "
                                     "It stays durable here; check the peers (--replica-peers)")
            return result
        log_event(log, "snapshot_replicated", snapshot_id=index.snapshot_id, peer=str(replicated.path),
                  bytes=index.total_bytes, seconds=round(time.monotonic() - mirror.began, 3))
        self.states.settle(index.job_id, index.step, "replicated", peer=str(replicated.path), nbytes=index.total_bytes)
        return result

    def discard(self, target: StepWrite) -> bool:
        mirror = self._forget(target)
        if mirror is not None:
            if mirror.target is not None:
                self.mirror.discard(mirror.target)
            self.states.settle(mirror.plan.job_id, mirror.plan.step, "failed",
                               error="not replicated: the snapshot failed")
        return self.primary.discard(target)

    def _mirror(self, target: StepWrite) -> _Mirror:
        """The step's mirror, prepared on the peer by the first caller (a refusal fails it)."""
        with self._lock:
            mirror = self._mirrors[str(target.location)]
        with mirror.lock:
            if mirror.target is None and not mirror.error:
                try:
                    mirror.target = self.mirror.prepare(mirror.plan)
                except Exception as exc:  # the mirror's failure, a bug included, is never the step's
                    mirror.error = _why(exc)
        return mirror

    def _try(self, mirror: _Mirror, call: Callable[[StepWrite], T]) -> T | None:
        """``call(mirror's target)``, unless the mirror failed; a failure fails it (None)."""
        if mirror.error or mirror.target is None:
            return None
        try:
            return call(mirror.target)
        except Exception as exc:  # the mirror's failure, a bug included, is never the step's
            self._fail(mirror, exc)
            return None

    def _fail(self, mirror: _Mirror, exc: BaseException) -> None:
        with mirror.lock:
            mirror.error = mirror.error or _why(exc)

    def _forget(self, target: StepWrite) -> _Mirror | None:
        with self._lock:
            return self._mirrors.pop(str(target.location), None)


class _TeeSink(ChunkSink):
    """A data file into the primary's sink and each piece, as the primary placed it, to the peer's (their crc32 is the
    file's: the peer checks it), opened by ``open_copy`` with the first piece (None: the mirror failed). The copy's
    failure is handed to ``failed`` and ends the copy, never the file."""

    def __init__(self, primary: ChunkSink, open_copy: Callable[[], SendingSink | None],
                 failed: Callable[[BaseException], None]):
        super().__init__()
        self.direct = primary.direct
        self._primary, self._failed = primary, failed
        self._open_copy: Callable[[], SendingSink | None] | None = open_copy
        self._copy: SendingSink | None = None

    def room(self) -> int:
        return min(self._primary.room(), DATA_FRAME_BYTES) if self._copying() else self._primary.room()

    @property
    def stager_first(self) -> bool:  # while the copy is sent, its sends compete with the stager too
        return self._copying() or self._primary.stager_first

    def _copying(self) -> bool:
        return self._copy is not None or self._open_copy is not None

    def put(self, data: memoryview, stable: bool = False) -> memoryview:
        return self._mirrored(self._primary.put(data, stable), stable)

    def replace(self, data: memoryview, stable: bool = False) -> memoryview:
        return self._mirrored(self._primary.replace(data, stable), stable)

    def map(self, nbytes: int) -> int | None:
        return self._primary.map(nbytes)

    def put_mapped(self, nbytes: int) -> memoryview:
        return self._mirrored(self._primary.put_mapped(nbytes), stable=True)

    def _mirrored(self, placed: memoryview, stable: bool) -> memoryview:  # stable: the source's, or the primary's own
        self._on_copy(lambda copy: copy.put(placed, stable or self._primary.owns_placed).release())
        return placed

    def advance(self) -> None:
        self._primary.advance()
        self._on_copy(lambda copy: copy.advance())
        self.position = self._primary.position

    def finish(self) -> None:
        self._primary.finish()
        self._on_copy(lambda copy: copy.finish())

    def close(self) -> None:
        try:
            if self._copy is not None:
                self._copy.close()
        finally:
            self._primary.close()

    def _on_copy(self, call: Callable[[SendingSink], object]) -> None:
        if self._open_copy is not None:
            open_copy, self._open_copy = self._open_copy, None
            self._copy = open_copy()
        if self._copy is None:
            return
        try:
            call(self._copy)
        except Exception as exc:  # the copy's failure, a bug included, is never the file's
            copy, self._copy = self._copy, None
            with contextlib.suppress(Exception):
                copy.close()
            self._failed(exc)


def _why(exc: BaseException) -> str:
    """An expected failure's own message; an unexpected one's type too (a bug to report)."""
    return str(exc) if isinstance(exc, (OSError, SnapshotError)) else f"unexpected error: {exc!r}"
