"""Snapshots in the store (``--snapshot-store``): the layout every host writes, every host reads.

Layout under the store's root (an :class:`~.object_store.ObjectStore`)::

    <job>/step-<N:012d>/rank-00000.safetensors    the rank's data file, byte for byte the local one
    <job>/step-<N:012d>/rank-00000.manifest.json  its manifest
    <job>/step-<N:012d>/rank-00000.stored.json    its marker, after its files: a SnapshotIndex of ranks [0]
    <job>/step-<N:012d>/host-00000-00008-of-00016.part.json  a host's part (first rank, count, world size),
                                                  after its markers: a SnapshotIndex of its ranks and their
                                                  part of the layout index (``layout-names.<digest>.json``)
    <job>/step-<N:012d>/layout.json               the step's layout index, put just before its index
    <job>/step-<N:012d>/snapshot.json             the step's index (all ranks' files and the layout's),
                                                  put once every rank's marker and host part is there

A step is *complete* when the markers of every rank ``0..world_size-1`` are there and agree on the world size and the
attempt, so a reader never sees a partial step nor one mixing two attempts (how hosts write it:
``swap_state.server.snapshot.tiers.store``). Nothing read is trusted: a marker must name its own job, step and rank. A
step without its index is read from its hosts' parts (one read per host), the markers listed, not read; a step written
before host parts, from every marker (logged: N reads).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import pathlib
import re
import threading
from collections.abc import Iterable, Iterator

from .names import parse_snapshot_id, parse_step_dir_name, snapshot_id_for, step_dir_name, validate_job_id
from .object_store import ObjectInfo, ObjectStore
from .snapshot_errors import SnapshotCorruptError, SnapshotInvalid, SnapshotNotFoundError, StoreUnavailableError
from .snapshot_format import INDEX_NAME, SnapshotIndex, rank_data_name, rank_manifest_name
from .snapshot_tier import SnapshotInfo, SnapshotTier

__all__ = ["CLAIM_PREFIX", "StorePath", "StoredSnapshots", "covered", "marker_name", "names_key", "parse_marker_name",
           "part_name"]

log = logging.getLogger(__name__)

_MARKER_SUFFIX = ".stored.json"
CLAIM_PREFIX = "publishing.attempt-"
"""``publishing.attempt-<A>``: created by the host that puts attempt A's indexes."""
_MARKER_NAME = re.compile(r"rank-([0-9]{5})" + re.escape(_MARKER_SUFFIX))
_MAX_CACHED_MARKERS = 1 << 16
_PART_NAME = re.compile(r"host-([0-9]{5})-([0-9]{5})-of-([0-9]{5})\.part\.json")


def marker_name(rank: int) -> str:
    return f"rank-{rank:05d}{_MARKER_SUFFIX}"


def parse_marker_name(name: str) -> int | None:
    match = _MARKER_NAME.fullmatch(name)
    return int(match[1]) if match else None


def part_name(first: int, count: int, world_size: int) -> str:
    return f"host-{first:05d}-{count:05d}-of-{world_size:05d}.part.json"


def names_key(names: bytes) -> str:
    """The name of a host part's ``layout-names`` object: its content's digest (hosts of the
    same tensors put the same object; the publisher reads each distinct one once)."""
    return f"layout-names.{hashlib.sha256(names).hexdigest()[:32]}.json"


class StorePath(str):
    """A snapshot's place in the store, printed as a URI and joined like a path (``/``), so
    that messages built for local snapshots (``info.path / name``) name the object."""

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self.rstrip("/") + "/" + name)


class StoredSnapshots(SnapshotTier):
    """The snapshots in one store, read (and listed) by any host. Thread-safe."""

    where = "store"

    def __init__(self, store: ObjectStore):
        self.store = store
        self.uri = store.uri
        # (key, size, version) -> parsed; least recently used dropped first past the bound.
        self._markers: collections.OrderedDict[tuple[str, int, str], SnapshotIndex | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[None]:
        """A store request: a missing object is SnapshotCorruptError (a listed snapshot lost a file),
        any other failure StoreUnavailableError; both name the object."""
        try:
            yield
        except FileNotFoundError as error:
            raise SnapshotCorruptError(f"{self.store.describe(key)} is missing from the store") from error
        except OSError as error:
            raise StoreUnavailableError(f"reading {self.store.describe(key)} failed: {error}") from error

    @staticmethod
    def step_prefix(job_id: str, step: int) -> str:
        return f"{validate_job_id(job_id, SnapshotInvalid)}/{step_dir_name(step)}/"

    def key(self, job_id: str, step: int, name: str) -> str:
        return self.step_prefix(job_id, step) + name

    def list_step(self, job_id: str, step: int) -> list[ObjectInfo]:
        prefix = self.step_prefix(job_id, step)
        with self.reading(prefix):
            return self.store.list(prefix)

    def location(self, job_id: str, step: int) -> StorePath:
        return StorePath(self.store.describe(self.step_prefix(job_id, step)).rstrip("/"))

    def step_markers(self, job_id: str, step: int, ranks: Iterable[int] | None = None) -> dict[int, SnapshotIndex]:
        """The valid markers of one step, by rank (one listing); only those of ``ranks`` are read
        when given (a host asks for its own, not N requests per step)."""
        named = _markers_by_rank(self.list_step(job_id, step))
        wanted = named.keys() if ranks is None else set(ranks)
        return self.markers(job_id, step, {rank: info for rank, info in named.items() if rank in wanted})

    def markers(self, job_id: str, step: int, named: dict[int, ObjectInfo]) -> dict[int, SnapshotIndex]:
        """The valid markers of a step's marker objects by rank (an invalid one counts as absent)."""
        read = {rank: self._marker(info, job_id, step, rank) for rank, info in named.items()}
        return {rank: index for rank, index in read.items() if index is not None}

    def _marker(self, info: ObjectInfo, job_id: str, step: int, rank: int) -> SnapshotIndex | None:
        cache_key = (info.key, info.size, info.version)  # a marker put again is read again
        with self._lock:
            if cache_key in self._markers:
                self._markers.move_to_end(cache_key)
                return self._markers[cache_key]
        try:
            index = SnapshotIndex.parse(self.store.get(info.key), job_id, step)
        except FileNotFoundError:
            return None  # removed while listing: not cached
        if index is not None and (index.ranks != (rank,) or {r.name for r in index.files} != _rank_files([rank])):
            index = None
        with self._lock:
            self._markers[cache_key] = index
            while len(self._markers) > _MAX_CACHED_MARKERS:  # bounded: markers removed stay cached
                self._markers.popitem(last=False)
        return index

    def jobs(self) -> list[str]:
        with self.reading(""):
            return self.store.list_folders("")

    def steps(self, job_id: str) -> list[int]:
        """The steps of a job with anything in the store, ascending."""
        prefix = validate_job_id(job_id, SnapshotInvalid) + "/"
        with self.reading(prefix):
            names = self.store.list_folders(prefix)
        return sorted(step for name in names if (step := parse_step_dir_name(name)) is not None)

    def list(self, job_id: str | None = None) -> list[SnapshotInfo]:
        """The complete steps of one job (or all), by job then step; ``latest`` is each job's
        highest complete step. A listing of folders per job, then a read per step."""
        infos: list[SnapshotInfo] = []
        for job in [job_id] if job_id is not None else self.jobs():
            found = [info for step in self.steps(job) if (info := self.step_info(job, step)) is not None]
            infos.extend(found[:-1] + [dataclasses.replace(info, latest=True) for info in found[-1:]])
        return infos

    def step_info(self, job_id: str, step: int) -> SnapshotInfo | None:
        """The step as one snapshot when it is complete in the store (from its index, else its markers), else None."""
        index = self.step_index(job_id, step)
        if index is not None:
            return self._info(index)
        return self.complete_info(job_id, step, self.list_step(job_id, step))

    def step_index(self, job_id: str, step: int) -> SnapshotIndex | None:
        key = self.key(job_id, step, INDEX_NAME)
        try:
            raw = self.get(key)
        except SnapshotCorruptError:  # missing: a step being uploaded, or put before indexes
            return None
        index = SnapshotIndex.parse(raw, job_id, step)
        if index is None or not index.complete_job or not (
                _rank_files(range(index.world_size)) <= {record.name for record in index.files}):
            return None
        return index

    def complete_info(self, job_id: str, step: int, objects: list[ObjectInfo]) -> SnapshotInfo | None:
        """The step as one snapshot when its ``objects`` hold a marker of every rank; else None
        (names checked first: one marker read when a rank has none). With host parts, from them
        (one read per host); before them, from every marker."""
        named = _markers_by_rank(objects)
        if not named:
            return None
        if parts := _parts(objects):
            world_size = next((w for w in {key[2] for key in parts} if covered(objects, w)), None)
            found = None if world_size is None else self.host_parts(job_id, step, objects, world_size)
            if found is not None:
                log.info("store_step_from_parts: %s of %s has every host's part and no index (being published, or "
                         "its publisher failed): read from its %d parts", self.step_prefix(job_id, step), self.uri,
                         len(found[1]))
            return None if found is None else self._info(found[0])
        first = self._marker(named[min(named)], job_id, step, min(named))
        if first is None or sorted(named) != list(range(first.world_size)):
            return None
        log.warning("store_markers_read: %s of %s has no index and no host parts (written before them): reading its "
                    "%d markers", self.step_prefix(job_id, step), self.uri, len(named))
        markers = self.markers(job_id, step, named)
        index = _joined(job_id, step, first.world_size, [markers[rank] for rank in sorted(markers)])
        return None if index is None else self._info(index)

    def host_parts(self, job_id: str, step: int, objects: list[ObjectInfo],
                   world_size: int) -> tuple[SnapshotIndex, list[dict]] | None:
        """The step's index from its hosts' parts among ``objects`` (one read each), with the
        parts read, when they cover ranks ``0..world_size-1`` once and agree on the attempt and
        the tenant; None otherwise (one part missing, or a step being uploaded again)."""
        docs, indexes = [], []
        parts = sorted(_parts(objects, world_size).items())
        try:
            with concurrent.futures.ThreadPoolExecutor(min(16, len(parts) or 1)) as pool:  # a request each, overlapped
                raws = list(pool.map(self.get, [info.key for _, info in parts]))
        except SnapshotCorruptError:  # a part gone since the listing: the step is being deleted (retention)
            return None
        for ((first, count, _), info), raw in zip(parts, raws):
            try:
                doc = json.loads(raw)
                index = SnapshotIndex.from_json(doc)
            except (ValueError, RecursionError):
                return None
            names = {f.name for f in index.files}
            if (index.job_id, index.step, index.world_size, index.ranks[0], len(index.ranks)) != (
                    job_id, step, world_size, first, count) or names != _rank_files(index.ranks):
                return None
            docs.append(doc)
            indexes.append(index)
        joined = _joined(job_id, step, world_size, indexes)
        return None if joined is None else (joined, docs)

    def get(self, key: str) -> bytes:
        """One object, whole (as :meth:`reading` says when it fails)."""
        with self.reading(key):
            return self.store.get(key)

    def _info(self, index: SnapshotIndex) -> SnapshotInfo:
        return SnapshotInfo.of(index, self.location(index.job_id, index.step))  # type: ignore[arg-type]

    def resolve(self, snapshot_id: str, job_id: str | None = None) -> SnapshotInfo:
        """A complete snapshot in the store; SnapshotNotFoundError naming the store otherwise.
        ``latest``: the newest step that is complete (the steps below it are not read)."""
        ref = parse_snapshot_id(snapshot_id, job_id, SnapshotInvalid)
        steps = self.steps(ref.job_id)
        for step in reversed(steps) if ref.latest else [ref.step] if ref.step in steps else []:
            info = self.step_info(ref.job_id, step)
            if info is not None:
                return dataclasses.replace(info, latest=True) if ref.latest else info
        what = "no complete snapshot" if ref.latest else f"no complete snapshot {snapshot_id_for(ref.job_id, ref.step)}"
        complete = ", ".join(str(i.step) for i in self.list(ref.job_id)) or "none"
        raise SnapshotNotFoundError(f"{what} of job {ref.job_id!r} in the store {self.uri} (complete steps: [{complete}])")

    def _size(self, info: SnapshotInfo, name: str) -> int:
        key = self.key(info.job_id, info.step, name)
        with self.reading(key):
            size = self.store.size(key)
        if size is None:
            raise SnapshotCorruptError(f"{info.path / name} is missing")
        return size

    def _read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        key = self.key(info.job_id, info.step, name)
        with self.reading(key):
            return self.store.get_range(key, offset, nbytes)

    def local_file(self, info: SnapshotInfo, name: str) -> pathlib.Path | None:
        return self.store.local_path(self.key(info.job_id, info.step, name))


def covered(objects: Iterable[ObjectInfo], world_size: int) -> bool:
    """Whether ``objects`` (a step's) name a marker of every rank and host parts of as many ranks
    (names only: nothing is read)."""
    objects = list(objects)
    return sorted(_markers_by_rank(objects)) == list(range(world_size)) and \
        sum(count for _, count, _ in _parts(objects, world_size)) == world_size


def _parts(objects: Iterable[ObjectInfo], world_size: int | None = None) -> dict[tuple[int, int, int], ObjectInfo]:
    """A step's host parts (of ``world_size`` when given) by (first rank, count, world size)."""
    return {(int(m[1]), int(m[2]), int(m[3])): info for info in objects
            if (m := _PART_NAME.fullmatch(info.key.rsplit("/", 1)[-1])) and world_size in (None, int(m[3]))}


def _markers_by_rank(objects: Iterable[ObjectInfo]) -> dict[int, ObjectInfo]:
    return {rank: info for info in objects if (rank := parse_marker_name(info.key.rsplit("/", 1)[-1])) is not None}


def _rank_files(ranks: Iterable[int]) -> set[str]:
    return {name for rank in ranks for name in (rank_data_name(rank), rank_manifest_name(rank))}


def _joined(job_id: str, step: int, world_size: int, indexes: list[SnapshotIndex]) -> SnapshotIndex | None:
    """The step's index from its markers' or hosts' parts' (in rank order) when they hold ranks
    ``0..world_size-1`` once and agree on the world size, the attempt and the tenant; else None
    (an invalid one, or two attempts at the step: re-uploading, another world size)."""
    ranks = sorted(r for index in indexes for r in index.ranks)
    if ranks != list(range(world_size)) or len({(i.world_size, i.attempt, i.tenant) for i in indexes}) != 1 or \
            indexes[0].world_size != world_size:
        return None
    files = tuple(sorted((f for index in indexes for f in index.files), key=lambda f: f.rank))
    return SnapshotIndex(job_id, step, world_size, tuple(ranks), files, max(i.created_unix for i in indexes),
                         indexes[0].attempt, tenant=indexes[0].tenant)
