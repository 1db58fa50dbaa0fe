"""The second tier: each durable local snapshot's ranks uploaded to the store by one background worker (only the newest
queued snapshot of a job; the skipped ones fail ``stored``, saying so), through the store's write seam
(:class:`~.store.StoreTier`), each file's crc32 checked on the way, then the host's part; the step's index and retention
(:meth:`~.store.StoreTier.publish`) by a second thread, so the next upload never waits for them. A failing store fails
the upload, naming the URI; training goes on. Call order: ``SnapshotUploader(...)`` at start (it resumes unfinished
uploads), ``submit`` after each local commit, ``status`` / ``wait_async`` from the RPCs, ``close`` at shutdown (the
running upload is abandoned).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import queue
import threading
import time

from swap_state.common.object_store import STORE_FLAG
from swap_state.common.snapshot_errors import SnapshotError
from swap_state.common.snapshot_format import rank_data_name, rank_manifest_name
from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.common.stored_snapshots import part_name
from swap_state.server.logs import log_event
from swap_state.server.snapshot.restoring.layout_index import layout_part
from swap_state.server.snapshot.status import HISTORY, Recent, SnapshotState, SnapshotStatus
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.seam import StepPlan, copy_rank
from swap_state.server.snapshot.tiers.store import StoreTier
from swap_state.server.snapshot.waiting import WatchedCondition
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter

__all__ = ["StoreState", "UploadStatus", "UploadCounters", "SnapshotUploader", "HISTORY"]

log = logging.getLogger(__name__)


class StoreState(str, enum.Enum):
    """``SnapshotStatusReply.store_state``."""

    UPLOADING = "uploading"
    STORED = "stored"
    FAILED = "failed"


@dataclasses.dataclass
class UploadStatus:
    """One rank's upload."""

    state: StoreState  # uploading until its marker is in the store, then stored; or failed
    bytes_stored: int = 0
    error: str = ""  # why it failed, naming the store's URI


@dataclasses.dataclass
class UploadCounters:
    """Totals since the server started, for the metrics endpoint."""

    ranks_stored: int = 0  # ranks whose files and marker were put in the store
    ranks_failed: int = 0
    bytes_stored: int = 0
    seconds: float = 0.0  # snapshots' upload wall time


class SnapshotUploader:
    """Uploads durable local snapshots to the store, one worker thread."""

    def __init__(self, tier: StoreTier, local: SnapshotDirectory, max_bandwidth: float | None = None):
        self._tier = tier  # what the snapshots are written through
        self.stored = stored = tier.stored  # what the store holds, read
        self.uri = stored.uri
        self._local = local
        self._limiter = BandwidthLimiter(max_bandwidth)
        self._queue: queue.Queue[tuple[SnapshotInfo, int | None] | None] = queue.Queue()
        self._statuses: Recent[tuple[str, int], dict[int, UploadStatus]] = Recent()  # older: answered from the store
        self.counters = UploadCounters()
        self._cond = WatchedCondition()  # RPCs await uploads without holding a thread
        self._closed = threading.Event()
        self._current: tuple[str, int] | None = None  # (job, step) being read now
        local.in_use = self.in_use  # local retention keeps what is being uploaded
        try:
            stored.store.create_root()  # from now on a missing root is an unreachable store
        except OSError as exc:  # the uploads say it again, each, until it is fixed
            log_event(log, "store_unreachable", logging.WARNING, store=self.uri, error=str(exc),
                      detail="cannot create the store's root at start")
        self._finishing: queue.Queue = queue.Queue()  # (what, the call finishing a step) in order
        self._finisher = threading.Thread(target=self._finish_steps, name="snapshot-publish", daemon=True)
        self._finisher.start()
        self._thread = threading.Thread(target=self._work, name="snapshot-upload", daemon=True)
        self._thread.start()

    def stored_status(self, snapshot_id: str, rank: int) -> SnapshotStatus:
        """The status of a snapshot only the store holds (SnapshotNotFoundError naming it otherwise)."""
        info = self.stored.resolve(snapshot_id)
        status = SnapshotStatus.from_disk(info, self.stored.read_manifest(info, rank))
        return dataclasses.replace(status, state=SnapshotState.STORED, store_state=StoreState.STORED.value,
                                   store_path=str(info.path), path="")

    def submit(self, info: SnapshotInfo, keep: int | None) -> None:
        """Upload a durable local snapshot's ranks, then apply ``keep`` (None: keep all)."""
        with self._cond:
            self._statuses[(info.job_id, info.step)] = {rank: UploadStatus(StoreState.UPLOADING) for rank in info.ranks}
            self._cond.notify_all()
        self._queue.put((info, keep))

    def status(self, job_id: str, step: int, rank: int) -> UploadStatus | None:
        with self._cond:
            found = self._statuses.get((job_id, step), {}).get(rank)
            return dataclasses.replace(found) if found is not None else None

    async def wait_async(self, job_id: str, step: int, rank: int, timeout_s: float) -> UploadStatus | None:
        """Until the rank's upload is stored or failed, at most ``timeout_s``; holds no thread."""
        def settled() -> bool:  # under the lock; unknown here counts as settled
            found = self._statuses.get((job_id, step), {}).get(rank)
            return found is None or found.state is not StoreState.UPLOADING

        await self._cond.until(settled, timeout_s)
        return self.status(job_id, step, rank)

    def annotate(self, status: SnapshotStatus) -> SnapshotStatus:
        """A durable rank's status with the store's fields: stored once its marker is in the store
        (asked of the store for one never submitted here: not for the event loop)."""
        upload = self.status(status.job_id, status.step, status.rank)
        if upload is None:
            try:
                present = status.rank in self.stored.step_markers(status.job_id, status.step, [status.rank])
                error = "" if present else f"not in the store {self.uri} (taken before this server started)"
            except SnapshotError as exc:
                present, error = False, str(exc)
            upload = UploadStatus(StoreState.STORED if present else StoreState.FAILED, error=error)
        state = SnapshotState.STORED if upload.state is StoreState.STORED else status.state
        return dataclasses.replace(status, state=state, store_state=upload.state.value, store_error=upload.error,
                                   store_path=str(self.stored.location(status.job_id, status.step)),
                                   bytes_stored=upload.bytes_stored)

    def resume_pending(self) -> list[str]:
        """At start: each job's newest local snapshot not all in the store (a marker or its host part
        missing) is uploaded again; their ids."""
        pending = []
        for info in {info.job_id: info for info in self._local.reader.list()}.values():
            part = self.stored.key(info.job_id, info.step, part_name(info.ranks[0], len(info.ranks), info.world_size))
            if set(info.ranks) - set(self.stored.step_markers(info.job_id, info.step, info.ranks)) \
                    or self.stored.store.size(part) is None:
                self.submit(info, None)
                pending.append(info.snapshot_id)
        return pending

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._finishing.put(None)
        self._finisher.join(timeout_s)

    def drain(self, timeout_s: float) -> bool:
        """Whether every step handed on was finished (index, retention) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._finishing.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._finishing.unfinished_tasks

    def _finish_steps(self) -> None:
        while (item := self._finishing.get()) is not None:
            try:
                item()
            except Exception as exc:  # a bug must not end the thread: the step reads from its parts
                log_event(log, "store_index_failed", logging.ERROR, store=self.uri, error=repr(exc))
            finally:
                self._finishing.task_done()

    def _work(self) -> None:
        try:
            resumed = self.resume_pending()
        except (OSError, SnapshotError) as exc:
            log_event(log, "store_unreachable", logging.ERROR, store=self.uri, error=str(exc),
                      detail="could not check for uploads a previous server left unfinished")
        else:
            if resumed:
                log_event(log, "store_upload_resumed", snapshot_ids=resumed, store=self.uri)
        while not self._closed.is_set():
            item = self._queue.get()
            if item is None:
                return
            info, keep = self._newest_queued(item)
            self._current = (info.job_id, info.step)
            try:
                self._upload_ranks(info, keep)
            finally:
                self._current = None

    def _newest_queued(self, item: tuple[SnapshotInfo, int | None]) -> tuple[SnapshotInfo, int | None]:
        """``item``, unless a newer snapshot of its job is queued behind it (the newest is what a
        lost host needs); the skipped ones fail ``stored``; other jobs' items keep their places."""
        pending: list[tuple[SnapshotInfo, int | None] | None] = []
        with contextlib.suppress(queue.Empty):
            while True:
                pending.append(self._queue.get_nowait())
        for other in pending:
            if other is not None and other[0].job_id == item[0].job_id and other[0].step > item[0].step:
                self._skip(item[0], other[0])
                item = other
            else:
                self._queue.put(other)
        return item

    def _skip(self, info: SnapshotInfo, newer: SnapshotInfo) -> None:
        with self._cond:
            for status in self._statuses.get((info.job_id, info.step), {}).values():
                status.state = StoreState.FAILED
                status.error = (f"not uploaded to {self.uri}: {newer.snapshot_id} was taken before the store "
                                f"took it, and only the newest of a job is uploaded; it stays durable in {info.path}")
            self._cond.notify_all()
        log_event(log, "store_upload_superseded", snapshot_id=info.snapshot_id, by=newer.snapshot_id, store=self.uri)

    def in_use(self, job_id: str) -> set[int]:
        """The step of ``job_id`` being uploaded now, if any: local retention keeps it."""
        current = self._current
        return {current[1]} if current is not None and current[0] == job_id else set()

    def _upload_ranks(self, info: SnapshotInfo, keep: int | None) -> None:
        begin, local = time.monotonic(), info.index
        plan = StepPlan(info.job_id, info.step, info.world_size, info.ranks, local.tenant, keep, source=local)
        rank = info.ranks[0]
        try:
            target = self._tier.prepare(plan)  # one listing of the step for all its ranks
            for rank in target.ranks:
                copy_rank(self._local.reader, info, rank, self._tier, target, self._limiter, self._closed,
                          lambda size, rank=rank: self._set(info, rank, bytes_stored=size))
            # The host's part after its markers (with it its ranks count): the whole job's layout
            # index, or this host's ranks' records for their part of it.
            layout = self._local.reader.read_layout(info) if local.complete_job else None
            tensors = None if layout else {r: self._local.reader.read_manifest(info, r).tensors for r in info.ranks}
            self._tier.put_part(plan, None if tensors is None else layout_part(tensors))
        except (OSError, SnapshotError) as exc:
            self._fail(info, rank, exc)
            return
        for rank in info.ranks:
            nbytes = info.file(rank_data_name(rank)).bytes + info.file(rank_manifest_name(rank)).bytes
            # Counted before the rank reads stored: a scrape after wait_stored sees its bytes.
            self.counters.bytes_stored += nbytes
            self.counters.ranks_stored += 1
            self._set(info, rank, state=StoreState.STORED, bytes_stored=nbytes)
        # The step's index and retention: they only warn, off this thread.
        self._finishing.put(lambda: self._tier.publish(target, local, layout))
        seconds = time.monotonic() - begin
        self.counters.seconds += seconds
        log_event(log, "snapshot_stored", snapshot_id=info.snapshot_id, ranks=list(info.ranks),
                  store=self.uri, bytes=info.bytes, seconds=round(seconds, 3),
                  bytes_per_s=int(info.bytes / seconds) if seconds > 0 else None)

    def _set(self, info: SnapshotInfo, rank: int, **changes) -> None:
        with self._cond:
            status = self._statuses.get((info.job_id, info.step), {}).get(rank)
            if status is not None:
                for name, value in changes.items():
                    setattr(status, name, value)
            self._cond.notify_all()

    def _fail(self, info: SnapshotInfo, rank: int, exc: BaseException) -> None:
        if not os.path.isdir(info.path):  # gone locally before its turn came: not the store's fault
            error = (f"{info.snapshot_id} was not uploaded to {self.uri}: local retention (--keep-latest) "
                     "removed it first; newer snapshots are uploaded")
        else:
            error = (
                f"uploading rank {rank} of {info.snapshot_id} to the snapshot store {self.uri} failed: "
                f"{exc}. The snapshot stays durable in {info.path} and training goes on; check the "
                f"store ({STORE_FLAG}; for s3, AWS_ENDPOINT_URL and the credentials)")
        log_event(log, "snapshot_store_failed", logging.ERROR, snapshot_id=info.snapshot_id,
                  rank=rank, store=self.uri, error=str(exc))
        with self._cond:
            for status in self._statuses.get((info.job_id, info.step), {}).values():
                if status.state is StoreState.UPLOADING:
                    status.state, status.error = StoreState.FAILED, error
                    self.counters.ranks_failed += 1
            self._cond.notify_all()
