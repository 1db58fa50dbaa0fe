"""The store's writer (``--snapshot-store``): :class:`StoreTier`, the :class:`~.seam.TierWriter` of
the layout :mod:`swap_state.common.stored_snapshots` reads. Commit rule: each host puts its ranks'
objects, then each rank's marker, last; a host that then lists every rank's marker puts
``layout.json`` then ``snapshot.json`` (the one that creates the attempt's claim object; the host
that lists last sees every marker, so a complete step gets its index). A step trained again: the
index and the rank's old marker go before its new data. Retention removes index and markers first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from swap_state.common.checksum import crc32
from swap_state.common.object_store import ObjectWriter
from swap_state.common.snapshot_errors import SnapshotError, StoreUnavailableError
from swap_state.common.snapshot_format import (
    INDEX_NAME, LAYOUT_NAME, FileRecord, SnapshotIndex, dumps_json, rank_data_name, rank_manifest_name)
from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.common.stored_snapshots import CLAIM_PREFIX, StoredSnapshots, marker_name, parse_marker_name
from swap_state.server.logs import log_event
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex
from swap_state.server.snapshot.tiers.seam import CommitResult, StepPlan, StepWrite, TierWriter
from swap_state.server.snapshot.writing.sink import ChunkSink

__all__ = ["StoreTier"]

log = logging.getLogger(__name__)

class StoreTier(TierWriter):
    """Writes copies of durable snapshots (``plan.source`` required) into one store. Thread-safe."""

    def __init__(self, stored: StoredSnapshots):
        self.stored = stored  # the store's reader: markers, indexes, layout
        self.store = stored.store
        self.root = stored.uri

    def prepare(self, plan: StepPlan) -> StepWrite:
        """One listing of the step: a rank whose marker already records the same files is skipped;
        a rank of another attempt has the step's index and its marker deleted (unlisted before its
        data changes); SnapshotError when a marker is another tenant's."""
        source = plan.source
        if source is None:
            raise ValueError("the store writes copies of durable snapshots: StepPlan.source is required")
        existing = self.stored.step_markers(plan.job_id, plan.step, plan.ranks)
        location = self.stored.location(plan.job_id, plan.step)
        todo = []
        for rank in plan.ranks:
            have = existing.get(rank)
            if have is not None and have.tenant != plan.tenant:
                raise SnapshotError(f"{location} belongs to another tenant: its objects are left alone (two tenants "
                                    "used one job id)")
            files = (source.file(rank_data_name(rank)), source.file(rank_manifest_name(rank)))
            if have is None or (have.world_size, have.attempt, have.files) != (plan.world_size, source.attempt, files):
                if have is not None:
                    self.store.delete(self._key(plan, INDEX_NAME))
                    self.store.delete(self._key(plan, marker_name(rank)))
                todo.append(rank)
        return StepWrite(plan, location, tuple(todo))

    def open_file(self, target: StepWrite, name: str) -> ChunkSink:
        return _PutSink(self.store.open_writer(self._key(target.plan, name)))

    def write_file(self, target: StepWrite, name: str, data: bytes) -> None:
        self.store.put(self._key(target.plan, name), data)  # one request: a small object

    def finish_rank(self, target: StepWrite, rank: int, files: tuple[FileRecord, ...]) -> None:
        """The rank's marker, put last: a SnapshotIndex of ranks ``[rank]`` listing ``files``."""
        plan = target.plan
        marker = SnapshotIndex(plan.job_id, plan.step, plan.world_size, (rank,), files, time.time(),
                               plan.source.attempt if plan.source else 1, tenant=plan.tenant)
        self.store.put(self._key(plan, marker_name(rank)), dumps_json(marker.to_json()))

    def finish(self, target: StepWrite, index: SnapshotIndex, layout: bytes | None) -> CommitResult:
        """The step's index once every host's markers are there (failing, the step reads from its
        markers), then retention; both only warn: the ranks are stored with their markers."""
        plan, warnings = target.plan, []
        try:
            self.publish_step_index(plan.job_id, plan.step, lambda whole: layout or self._built_layout(whole))
        except (OSError, SnapshotError) as exc:
            warnings.append(f"the step's index was not put: {exc}")
            log_event(log, "store_index_failed", logging.WARNING, snapshot_id=index.snapshot_id,
                      store=self.stored.uri, error=str(exc))
        try:
            self._retain(plan.job_id, plan.keep)
        except (OSError, SnapshotError) as exc:
            warnings.append(f"retention failed: {exc}")
            log_event(log, "store_retention_failed", logging.WARNING, job_id=plan.job_id,
                      store=self.stored.uri, error=str(exc))
        return CommitResult(target.location, tuple(warnings))

    def discard(self, target: StepWrite) -> bool:
        """Nothing to remove: objects without their rank's marker are never read (retention removes them)."""
        return False

    def publish_step_index(self, job_id: str, step: int, layout: Callable[[SnapshotInfo], bytes] | None = None) -> bool:
        """Put the step's index when every rank's marker is there and none is yet (the same bytes
        whoever puts it); whether the step is complete. ``layout(step)``: the step's
        ``layout.json``, put before the index that records it."""
        prefix = self.stored.step_prefix(job_id, step)
        objects = self.stored.list_step(job_id, step)
        info = self.stored.complete_info(job_id, step, objects)
        if info is None:
            return False
        if any(o.key == prefix + INDEX_NAME for o in objects) or not self._claim(prefix, info.index.attempt):
            return True  # put already, or another host that saw every marker puts it
        index = info.index
        if layout is not None:
            raw = layout(info)
            with self.stored.reading(prefix + LAYOUT_NAME):
                self.store.put(prefix + LAYOUT_NAME, raw)
            index = dataclasses.replace(index, layout=FileRecord(LAYOUT_NAME, -1, len(raw), crc32(raw)))
        with self.stored.reading(prefix + INDEX_NAME):
            self.store.put(prefix + INDEX_NAME, dumps_json(index.to_json()))
        return True

    def _claim(self, prefix: str, attempt: int) -> bool:
        """Whether this host puts the step's indexes: it created the attempt's claim object, or
        the store has no conditional writes (then each host puts the same bytes)."""
        key = f"{prefix}{CLAIM_PREFIX}{attempt}"
        try:
            with self.stored.reading(key):
                return self.store.create(key, b"")
        except StoreUnavailableError:
            return True

    def _built_layout(self, whole: SnapshotInfo) -> bytes:
        """The step's ``layout.json`` from every rank's manifest in the store (no host holds all)."""
        manifests = {rank: self.stored.read_manifest(whole, rank).tensors for rank in whole.ranks}
        try:
            return LayoutIndex(manifests, whole.world_size).to_bytes()
        except Exception as exc:  # a bug must not end the upload worker: the step reads from its markers
            raise SnapshotError(f"building the layout index of {whole.snapshot_id}: {exc!r}") from exc

    def _retain(self, job_id: str, keep: int | None) -> None:
        if keep is None:
            return
        complete = [info.step for info in self.stored.list(job_id)]
        if not complete:
            return
        oldest_kept = complete[-keep:][0]
        for step in self.stored.steps(job_id):
            if step >= oldest_kept:
                break
            prefix = self.stored.step_prefix(job_id, step)
            objects = [o.key for o in self.store.list(prefix)]
            first = [k for k in objects if k == prefix + INDEX_NAME or parse_marker_name(k.rsplit("/", 1)[-1]) is not None]
            for key in sorted(first, key=lambda k: not k.endswith(INDEX_NAME)) + [k for k in objects if k not in first]:
                self.store.delete(key)
            log_event(log, "store_retention_removed", snapshot_id=f"{job_id}/step-{step}", store=self.stored.uri)

    def _key(self, plan: StepPlan, name: str) -> str:
        return self.stored.key(plan.job_id, plan.step, name)


class _PutSink(ChunkSink):
    """A ChunkSink over one object's writer: a piece goes to the store once final (``advance``);
    the object is visible only once :meth:`finish` returned, closed before, it is abandoned."""

    def __init__(self, writer: ObjectWriter):
        super().__init__()
        self._writer: ObjectWriter | None = writer
        self._held: bytes = b""

    def room(self) -> int:
        return 1 << 62

    def put(self, data: memoryview, crc: int) -> int:
        # A whole bytes block is held as it is; any other view is copied: its buffer is the caller's.
        self._held = data.obj if isinstance(data.obj, bytes) and data.nbytes == len(data.obj) else bytes(data)
        self._pending = data.nbytes
        return crc32(data, crc)

    def advance(self) -> None:
        self._live().write(self._held)
        self._held, self.position, self._pending = b"", self.position + self._pending, 0

    def finish(self) -> None:
        writer, self._writer = self._live(), None
        try:
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abort()

    def _live(self) -> ObjectWriter:
        if self._writer is None:
            raise ValueError("the object was committed or abandoned")
        return self._writer
