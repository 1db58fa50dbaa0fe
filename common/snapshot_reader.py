"""Where complete snapshots are read from (:class:`SnapshotTier`), and a snapshot directory
read only (:class:`SnapshotReader`): list, resolve, read manifests and tensors, verify.

Directory layout under the snapshot root (``--snapshot-dir``)::

    <root>/<job_id>/step-<N:012d>/          complete snapshots (snapshot.json present)
    <root>/<job_id>/.partial-step-<N:012d>/ a snapshot being written (never listed)
    <root>/<job_id>/.deleting-step-<N>/     an old snapshot being removed by retention
    <root>/<job_id>/latest                  "step-<N:012d>": the last committed snapshot

A directory is listed only when its ``snapshot.json`` parses and names the same job and step,
so a half-written snapshot is never listed or loaded. Used by the client's export (offline) and
by the server's store. Reading needs no lock: the writer publishes by atomic rename.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
import json
import math
import os
import pathlib
from collections.abc import Iterator, Sequence

from .checksum import crc32
from .dtypes import DTYPE_ITEMSIZE
from .names import is_job_id, parse_snapshot_id, parse_step_dir_name, snapshot_id_for, validate_job_id
from .object_store import read_range
from .snapshot_errors import SnapshotCorrupt, SnapshotError, SnapshotInvalid, SnapshotNotFound
from .snapshot_format import (
    INDEX_NAME, LATEST_NAME, FileRecord, RankManifest, SnapshotIndex, TensorRecord, rank_data_name, rank_manifest_name,
)

__all__ = ["SnapshotInfo", "SnapshotReader", "SnapshotTier", "reading_file"]

_ELSEWHERE = ("was it taken by another server (another host, or an embedded server with its own snapshot "
              "directory) or with another --snapshot-dir? Point the server (or swap-state export "
              "--snapshot-dir) at that directory")


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """A complete snapshot as listed."""

    snapshot_id: str
    """``<job_id>/step-<step>``."""
    job_id: str
    step: int
    world_size: int
    """The job's (global) number of ranks."""
    path: pathlib.Path
    bytes: int
    """Total size of its files."""
    latest: bool
    """Whether ``latest`` of its job resolves to it."""
    index: SnapshotIndex = dataclasses.field(repr=False, compare=False)

    @classmethod
    def of(cls, index: SnapshotIndex, path: pathlib.Path, latest: bool = False) -> SnapshotInfo:
        return cls(snapshot_id_for(index.job_id, index.step), index.job_id, index.step, index.world_size,
                   path, index.total_bytes, latest, index)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks whose files this directory holds (a subset on one host of several)."""
        return self.index.ranks

    @property
    def local_world_size(self) -> int:
        """How many ranks this directory holds."""
        return self.index.local_world_size

    def file(self, name: str) -> FileRecord:
        """The index's record of its file ``name``; SnapshotCorrupt when it lists none."""
        record = self.index.file(name)
        if record is None:
            raise SnapshotCorrupt(f"{self.path / INDEX_NAME} does not list {name}")
        return record

    def describe_ranks(self) -> str:
        """``ranks [2, 3] of world_size 4`` (ranges shortened for big jobs)."""
        return f"ranks {_rank_ranges(self.ranks)} of world_size {self.world_size}"


class SnapshotTier(abc.ABC):
    """The complete snapshots of one place, read and checked: a directory
    (:class:`SnapshotReader`) or an object store (:class:`~.stored_snapshots.StoredSnapshots`).
    Call order::

        info = tier.resolve(snapshot_id, job_id)      # or tier.list(job_id)
        tier.read_layout(info)                        # the step's layout index, when it has one
        manifest = tier.read_manifest(info, rank)     # each rank read from
        tier.check_data_header(info, manifest)        # once per data file read from
        tier.read_tensor(info, manifest, tensor)      # each tensor, its crc32 checked

    Every read is checked against what ``snapshot.json`` (a store's markers) records.
    Implementations override :meth:`list`, :meth:`resolve`, :meth:`_size` and :meth:`_read_range`.
    """

    where: str
    """``local`` or ``store``: what restore replies and logs say."""

    @abc.abstractmethod
    def list(self, job_id: str | None = None) -> list[SnapshotInfo]:
        """Complete snapshots of one job (or of all jobs), ordered by job, then step."""

    @abc.abstractmethod
    def resolve(self, snapshot_id: str, job_id: str | None = None) -> SnapshotInfo:
        """``<job>/step-<N>``, ``<job>/latest``, or ``latest`` / ``step-<N>`` of ``job_id``;
        SnapshotNotFound, saying where it looked, when no complete snapshot matches."""

    @abc.abstractmethod
    def _size(self, info: SnapshotInfo, name: str) -> int:
        """The size of the snapshot's file ``name``; SnapshotCorrupt when it is missing."""

    @abc.abstractmethod
    def _read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        """``nbytes`` of file ``name`` from ``offset`` (fewer only at its end)."""

    def read_manifest(self, info: SnapshotInfo, rank: int) -> RankManifest:
        """The rank's manifest, checked against the index; SnapshotNotFound when the rank is not
        here (on a multi-host job: on another host)."""
        if rank not in info.ranks:
            if not 0 <= rank < info.world_size:
                raise SnapshotNotFound(f"{info.snapshot_id} has world_size {info.world_size}: there is no rank {rank}")
            raise SnapshotNotFound(f"{info.snapshot_id} at {info.path} holds {info.describe_ranks()}, not rank "
                                   f"{rank}: the snapshot of rank {rank} is on another host's server (the one "
                                   f"rank {rank} attaches to)")
        name = rank_manifest_name(rank)
        raw = self._read_listed(info, info.file(name))
        try:
            manifest = RankManifest.from_json(json.loads(raw))
        except ValueError as exc:
            raise SnapshotCorrupt(f"{info.path / name} is not a valid manifest: {exc}") from None
        if (manifest.job_id, manifest.step, manifest.rank, manifest.world_size) != (
            info.job_id, info.step, rank, info.world_size,
        ) or manifest.data_file != rank_data_name(rank):
            raise SnapshotCorrupt(f"{info.path / name} describes another snapshot or rank")
        return manifest

    def read_layout(self, info: SnapshotInfo) -> bytes | None:
        """The step's ``layout.json``, checked against the index; None when it lists none."""
        return None if info.index.layout is None else self._read_listed(info, info.index.layout)

    def check_data_header(self, info: SnapshotInfo, manifest: RankManifest) -> None:
        """The data file's size and safetensors header, against the manifest and the index; the
        sizes the manifest implies are checked before a byte is read."""
        path, record, header = info.path / manifest.data_file, info.file(manifest.data_file), manifest.header_bytes()
        position = 0
        for tensor in manifest.tensors:
            nbytes = math.prod(tensor.shape) * DTYPE_ITEMSIZE[tensor.dtype]
            if tensor.nbytes != nbytes or tensor.data_offsets != (position, position + nbytes):
                raise SnapshotCorrupt(f"{path}: manifest entry of {tensor.name!r} is inconsistent")
            position += tensor.nbytes
        expected = len(header) + position
        if manifest.data_start != len(header) or manifest.data_file_bytes != expected:
            raise SnapshotCorrupt(f"{path}: manifest sizes do not match its tensors")
        size = self._size(info, manifest.data_file)
        if size != expected or size != record.bytes:
            raise SnapshotCorrupt(f"{path} is {size} bytes; its manifest implies {expected} and "
                                  f"{INDEX_NAME} says {record.bytes}")
        if self._read_range(info, manifest.data_file, 0, len(header)) != header:
            raise SnapshotCorrupt(f"{path}: safetensors header does not match its manifest")

    def read_tensor(self, info: SnapshotInfo, manifest: RankManifest, tensor: TensorRecord) -> bytes:
        """One tensor's bytes, checked against its crc32 (SnapshotCorrupt names file and tensor)."""
        data = self._read_range(info, manifest.data_file, manifest.data_start + tensor.data_offsets[0], tensor.nbytes)
        if len(data) != tensor.nbytes or crc32(data) != tensor.crc32:
            raise SnapshotCorrupt(f"{info.path / manifest.data_file}: tensor {tensor.name!r} fails its checksum")
        return data

    def local_file(self, info: SnapshotInfo, name: str) -> pathlib.Path | None:
        """Where the snapshot's file ``name`` is on this host's filesystem, for a tier that has
        one (restore maps it); None: read through :meth:`_read_range` only."""
        return None

    def _read_listed(self, info: SnapshotInfo, record: FileRecord) -> bytes:
        """A file the index lists, its size checked before it is read (a bad one may be huge),
        then its crc32."""
        size = self._size(info, record.name)
        if size != record.bytes:
            raise SnapshotCorrupt(f"{info.path / record.name} is {size} bytes, its index says {record.bytes}")
        raw = self._read_range(info, record.name, 0, size)
        if len(raw) != record.bytes or crc32(raw) != record.crc32:
            raise SnapshotCorrupt(f"{info.path / record.name} does not match its checksum in {INDEX_NAME}")
        return raw


class SnapshotReader(SnapshotTier):
    """A snapshot root directory, read only."""

    where = "local"

    def __init__(self, root: str | os.PathLike[str]):
        self.root = pathlib.Path(os.path.abspath(root))

    def job_dir(self, job_id: str) -> pathlib.Path:
        """``<root>/<job_id>``; refuses ids and symlinks that would leave the root."""
        path = self.root / validate_job_id(job_id, SnapshotInvalid)
        if os.path.dirname(os.path.realpath(path)) != os.path.realpath(self.root):
            raise SnapshotInvalid(f"job directory {path} resolves outside {self.root}")
        return path

    def jobs(self) -> list[str]:
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        return [name for name in names
                if is_job_id(name) and (self.root / name).is_dir() and not (self.root / name).is_symlink()]

    def load_index(self, job_id: str, path: pathlib.Path, step: int) -> SnapshotIndex | None:
        """The index of a complete snapshot directory, None when it is not one."""
        try:
            return SnapshotIndex.parse((path / INDEX_NAME).read_bytes(), job_id, step)
        except OSError:
            return None

    def complete(self, job_id: str) -> list[tuple[int, pathlib.Path, SnapshotIndex]]:
        """(step, directory, index) of every complete snapshot of ``job_id``."""
        job_dir = self.job_dir(job_id)
        try:
            names = os.listdir(job_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for name in names:
            step = parse_step_dir_name(name)
            index = None if step is None else self.load_index(job_id, job_dir / name, step)
            if index is not None:
                found.append((step, job_dir / name, index))
        return sorted(found, key=lambda item: item[0])

    def _latest_step(self, job_id: str, complete: Sequence[tuple[int, pathlib.Path, SnapshotIndex]]) -> int | None:
        """The pointer's step when it names a complete snapshot, else the highest step."""
        steps = [step for step, _, _ in complete]
        try:
            pointer = parse_step_dir_name((self.job_dir(job_id) / LATEST_NAME).read_text().strip())
        except OSError:
            pointer = None
        return pointer if pointer in steps else steps[-1] if steps else None

    def list(self, job_id: str | None = None) -> list[SnapshotInfo]:
        infos: list[SnapshotInfo] = []
        for job in [validate_job_id(job_id, SnapshotInvalid)] if job_id is not None else self.jobs():
            complete = self.complete(job)
            latest = self._latest_step(job, complete)
            infos.extend(SnapshotInfo.of(index, path, step == latest) for step, path, index in complete)
        return infos

    def resolve(self, snapshot_id: str, job_id: str | None = None) -> SnapshotInfo:
        ref = parse_snapshot_id(snapshot_id, job_id, SnapshotInvalid)
        job, snapshots = ref.job_id, self.list(ref.job_id)
        found = next((i for i in snapshots if (i.latest if ref.latest else i.step == ref.step)), None)
        if found is not None:
            return found
        if ref.latest:
            raise SnapshotNotFound(f"job {job!r} has no complete snapshot in {self.root}: {_ELSEWHERE}")
        raise SnapshotNotFound(f"no complete snapshot {ref} in {self.root}: "
                               + self._why_missing(ref.step, [info.step for info in snapshots]))

    def _why_missing(self, step: int, kept: list[int]) -> str:
        """Why a step the caller expects is not here, and which setting to change."""
        if kept and step < kept[0]:
            return (f"the job's oldest snapshot kept is step {kept[0]}, so retention removed it. The "
                    "server keeps the larger of its --keep-latest and the job's own retention (the "
                    "trainer sends torchtitan's checkpoint.keep_latest_k); raise that to keep more")
        listed = ", ".join(str(s) for s in kept) or "none"
        return (f"the job's snapshots here are steps [{listed}]. A snapshot still persisting when its server "
                "stopped or died is lost (it is never listed; the next one works); else " + _ELSEWHERE)

    def _size(self, info: SnapshotInfo, name: str) -> int:
        with reading_file(info.path / name):
            return (info.path / name).stat().st_size

    def _read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        with reading_file(info.path / name):
            return read_range(info.path / name, offset, nbytes)

    def local_file(self, info: SnapshotInfo, name: str) -> pathlib.Path:
        return info.path / name


def _rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``[0-2, 5]``; ``[2, 3]`` stays ``[2, 3]``."""
    parts: list[str] = []
    for _, group in itertools.groupby(enumerate(ranks), lambda item: item[1] - item[0]):
        run = [rank for _, rank in group]
        parts.extend([f"{run[0]}-{run[-1]}"] if len(run) >= 3 else map(str, run))
    return "[" + ", ".join(parts) + "]"


@contextlib.contextmanager
def reading_file(path: object) -> Iterator[None]:
    """A missing file is SnapshotCorrupt, any other failure to read it SnapshotError."""
    try:
        yield
    except FileNotFoundError:
        raise SnapshotCorrupt(f"{path} is missing") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from None
