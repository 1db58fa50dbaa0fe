"""The store's writer (``--snapshot-store``): :class:`StoreTier`, the :class:`~.seam.TierWriter` of the layout
:mod:`swap_state.common.stored_snapshots` reads. Commit rule: each host puts its ranks' objects, then each rank's
marker, then its host part (its ranks' files and their part of the layout index); a host that then lists every rank's
marker and every host's part (names only) creates the attempt's claim object and, only if it did, reads the parts (one
per host) and puts ``layout.json`` merged from them, then ``snapshot.json`` (the host that lists last sees every part,
so a complete step gets its index). No host reads a marker or a manifest of another's. A step trained again: the index,
the host's part and the rank's old marker go before its new data. Retention removes index and markers first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Sequence

from swap_state.common.checksum import crc32
from swap_state.common.object_store import ObjectWriter
from swap_state.common.snapshot_errors import SnapshotError, StoreUnavailableError
from swap_state.common.snapshot_format import (
    INDEX_NAME, LAYOUT_NAME, FileRecord, SnapshotIndex, dumps_json, rank_data_name, rank_manifest_name)
from swap_state.common.stored_snapshots import (
    CLAIM_PREFIX, StoredSnapshots, covered, marker_name, names_key, parse_marker_name, part_name)
from swap_state.server.logs import log_event
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex
from swap_state.server.snapshot.tiers.seam import CommitResult, StepPlan, StepWrite, TierWriter
from swap_state.server.snapshot.writing.sink import ChunkSink

__all__ = ["StoreTier", "parts_layout"]

log = logging.getLogger(__name__)
_NAMES_KEY = re.compile(r"layout-names\.[0-9a-f]{32}\.json")

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
        todo, unlisted = [], False
        for rank in plan.ranks:
            have = existing.get(rank)
            if have is not None and have.tenant != plan.tenant:
                raise SnapshotError(f"{location} belongs to another tenant: its objects are left alone (two tenants "
                                    "used one job id)")
            files = (source.file(rank_data_name(rank)), source.file(rank_manifest_name(rank)))
            if have is None or (have.world_size, have.attempt, have.files) != (plan.world_size, source.attempt, files):
                if have is not None:
                    if not unlisted:
                        self.store.delete(self._key(plan, INDEX_NAME))
                        for world in {plan.world_size, have.world_size}:
                            self.store.delete(self._key(plan, part_name(plan.ranks[0], len(plan.ranks), world)))
                        unlisted = True
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
        """The host's part (:meth:`put_part`, without its part of the layout index), then :meth:`publish`. The uploader
        calls the two itself: the part on its thread (its ranks count as stored from there), the rest on another."""
        self.put_part(target.plan, None)
        return self.publish(target, index, layout)

    def publish(self, target: StepWrite, index: SnapshotIndex, layout: bytes | None) -> CommitResult:
        """After the host's part: the step's index once every host's part is there (failing, the step reads from the
        parts), then retention; both only warn: the ranks are stored with their markers and part."""
        plan, warnings = target.plan, []
        try:
            self.publish_step_index(plan.job_id, plan.step, plan.source.attempt if plan.source else 1,
                                    plan.world_size, layout)
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

    def put_part(self, plan: StepPlan, part: tuple[list, list[str], list[int]] | None) -> None:
        """The host's part, after its markers: its ranks' files as a SnapshotIndex, and their part of the layout index
        (:func:`layout_part`: kinds here, tensor names in the ``layout-names`` object they share)."""
        source, ranks = plan.source, plan.ranks
        files = tuple(source.file(name) for r in ranks for name in (rank_data_name(r), rank_manifest_name(r)))
        doc = SnapshotIndex(plan.job_id, plan.step, plan.world_size, ranks, files, time.time(), source.attempt,
                            tenant=plan.tenant).to_json()
        if part is not None:
            kinds, names, kind_of = part
            raw = json.dumps({"names": names, "kind_of": kind_of}, separators=(",", ":")).encode()
            self.store.put(self._key(plan, names_key(raw)), raw)
            doc.update(layout_names=names_key(raw), layout_kinds=kinds)
        self.store.put(self._key(plan, part_name(ranks[0], len(ranks), plan.world_size)), json.dumps(doc, separators=(",", ":")).encode())

    def discard(self, target: StepWrite) -> bool:
        """Nothing to remove: objects without their rank's marker are never read (retention removes them)."""
        return False

    def publish_step_index(self, job_id: str, step: int, attempt: int, world_size: int,
                           layout: bytes | None = None) -> bool:
        """Put the step's index when every rank's marker and every host's part is listed and none
        is yet (one listing, then the claim, before anything is read); whether the step is
        complete. ``layout``: the step's ``layout.json`` when one host holds it all, else merged
        from the parts (a part without one: the index is put without, logged)."""
        prefix = self.stored.step_prefix(job_id, step)
        objects = self.stored.list_step(job_id, step)
        if any(o.key == prefix + INDEX_NAME for o in objects):
            return True
        if not covered(objects, world_size):
            return False
        if not self._claim(prefix, attempt):
            return True  # another host that saw every part puts it
        found = self.stored.host_parts(job_id, step, objects, world_size)
        if found is None or found[0].attempt != attempt:  # a step being uploaded again: its last host puts it
            log_event(log, "store_index_deferred", snapshot_id=f"{job_id}/step-{step}", store=self.stored.uri,
                      detail="the hosts' parts disagree (a step being uploaded again): the claim is given back")
            self.store.delete(f"{prefix}{CLAIM_PREFIX}{attempt}")
            return False
        index, docs = found
        if layout is None:
            try:
                layout = parts_layout(self.stored, prefix, docs, world_size).to_bytes()
            except ValueError as exc:
                log_event(log, "store_layout_unbuilt", logging.WARNING, snapshot_id=index.snapshot_id,
                          store=self.stored.uri, error=str(exc),
                          detail="the index is put without layout.json: restores plan from the hosts' parts")
        if layout is not None:
            with self.stored.reading(prefix + LAYOUT_NAME):
                self.store.put(prefix + LAYOUT_NAME, layout)
            index = dataclasses.replace(index, layout=FileRecord(LAYOUT_NAME, -1, len(layout), crc32(layout)))
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

    def _retain(self, job_id: str, keep: int | None) -> None:
        if keep is None or not (complete := [info.step for info in self.stored.list(job_id)]):
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


def parts_layout(stored: StoredSnapshots, prefix: str, docs: Sequence[dict], world_size: int) -> LayoutIndex:
    """A step's layout index merged from its hosts' parts (``docs``), each distinct ``layout-names``
    object read once; ValueError when a part has none or they do not merge."""
    names: dict[str, tuple] = {}
    parts = []
    for doc in docs:
        key = doc.get("layout_names")
        if not isinstance(key, str) or not _NAMES_KEY.fullmatch(key):
            raise ValueError(f"the host part of ranks {doc.get('ranks', [])[:1]}... holds no part of the layout index")
        if key not in names:
            raw = stored.get(prefix + key)
            if names_key(raw) != key:
                raise ValueError(f"{prefix + key} does not hold what its name says")
            try:
                got = json.loads(raw)
                names[key] = (got["names"], got["kind_of"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{prefix + key} is not a layout-names object: {exc!r}") from None
        parts.append((doc.get("layout_kinds"), *names[key]))
    return LayoutIndex.merged(parts, world_size)


class _PutSink(ChunkSink):
    """A ChunkSink over one object's writer: a piece goes to the store once final (``advance``);
    the object is visible only once :meth:`finish` returned, closed before, it is abandoned."""

    def __init__(self, writer: ObjectWriter):
        super().__init__()
        self._writer: ObjectWriter | None = writer
        self._held: bytes = b""

    def room(self) -> int:
        return 1 << 62

    def put(self, data: memoryview, stable: bool = False) -> memoryview:
        # A whole bytes block is held as it is; any other view is copied: its buffer is the caller's.
        self._held = data.obj if isinstance(data.obj, bytes) and data.nbytes == len(data.obj) else bytes(data)
        self._pending = data.nbytes
        return memoryview(self._held)

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
