"""Where complete snapshots are read from: the tier seam (:class:`SnapshotTier`, a directory or an object store), what
it lists (:class:`SnapshotInfo`), and :func:`reading_file`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
import json
import pathlib
from collections.abc import Iterator, Sequence

from .checksum import crc32
from .names import snapshot_id_for
from .segment import tensor_nbytes
from .snapshot_errors import SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from .snapshot_format import INDEX_NAME, FileRecord, RankManifest, SnapshotIndex, TensorRecord, rank_data_name, rank_manifest_name

__all__ = ["SnapshotInfo", "SnapshotTier", "reading_file"]


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """A complete snapshot as a tier lists it."""

    snapshot_id: str
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
        return self.index.ranks

    @property
    def local_world_size(self) -> int:
        return self.index.local_world_size

    def file(self, name: str) -> FileRecord:
        """The index's record of its file ``name``; SnapshotCorruptError when it lists none."""
        record = self.index.file(name)
        if record is None:
            raise SnapshotCorruptError(f"{self.path / INDEX_NAME} does not list {name}")
        return record

    def describe_ranks(self) -> str:
        """``ranks [0-2, 5] of world_size 8``."""
        return f"ranks {_rank_ranges(self.ranks)} of world_size {self.world_size}"


class SnapshotTier(abc.ABC):
    """The complete snapshots of one place, read and checked: a directory (:class:`~.snapshot_reader.SnapshotReader`)
    or an object store (:class:`~.stored_snapshots.StoredSnapshots`). Call order::

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
        SnapshotNotFoundError, saying where it looked, when no complete snapshot matches."""

    @abc.abstractmethod
    def _size(self, info: SnapshotInfo, name: str) -> int:
        """The size of the snapshot's file ``name``; SnapshotCorruptError when it is missing."""

    @abc.abstractmethod
    def _read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        """``nbytes`` of file ``name`` from ``offset`` (fewer only at its end)."""

    def places(self, info: SnapshotInfo, ranks: Sequence[int]) -> list[str]:
        """Where those ranks' files of the snapshot are read from (for the logs)."""
        return [str(info.path)]

    def size(self, info: SnapshotInfo, name: str) -> int:
        return self._size(info, name)

    def read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        """Bytes of file ``name``, unchecked: for a reader on another host (a peer server), which
        checks them against the index it was sent, or for a tier made of others."""
        return self._read_range(info, name, offset, nbytes)

    def read_manifest(self, info: SnapshotInfo, rank: int) -> RankManifest:
        """The rank's manifest, checked against the index; SnapshotNotFoundError when the rank is not
        here (on a multi-host job: on another host)."""
        if rank not in info.ranks:
            if not 0 <= rank < info.world_size:
                raise SnapshotNotFoundError(f"{info.snapshot_id} has world_size {info.world_size}: there is no rank {rank}")
            raise SnapshotNotFoundError(f"{info.snapshot_id} at {info.path} holds {info.describe_ranks()}, not rank "
                                   f"{rank}: the snapshot of rank {rank} is on another host's server (the one "
                                   f"rank {rank} attaches to)")
        name = rank_manifest_name(rank)
        raw = self.read_listed(info, info.file(name))
        try:
            manifest = RankManifest.from_json(json.loads(raw))
        except ValueError as exc:
            raise SnapshotCorruptError(f"{info.path / name} is not a valid manifest: {exc}") from None
        if (manifest.job_id, manifest.step, manifest.rank, manifest.world_size) != (
            info.job_id, info.step, rank, info.world_size) or manifest.data_file != rank_data_name(rank):
            raise SnapshotCorruptError(f"{info.path / name} describes another snapshot or rank")
        return manifest

    def read_layout(self, info: SnapshotInfo) -> bytes | None:
        """The step's ``layout.json``, checked against the index; None when it lists none."""
        return None if info.index.layout is None else self.read_listed(info, info.index.layout)

    def check_data_header(self, info: SnapshotInfo, manifest: RankManifest) -> None:
        """The data file's size and safetensors header, against the manifest and the index; the
        sizes the manifest implies are checked before a byte is read."""
        path, record, header = info.path / manifest.data_file, info.file(manifest.data_file), manifest.header_bytes()
        position = 0
        for tensor in manifest.tensors:
            nbytes = tensor_nbytes(tensor.dtype, tensor.shape)
            if tensor.nbytes != nbytes or tensor.data_offsets != (position, position + nbytes):
                raise SnapshotCorruptError(f"{path}: manifest entry of {tensor.name!r} is inconsistent")
            position += tensor.nbytes
        expected = len(header) + position
        if manifest.data_start != len(header) or manifest.data_file_bytes != expected:
            raise SnapshotCorruptError(f"{path}: manifest sizes do not match its tensors")
        size = self._size(info, manifest.data_file)
        if size != expected or size != record.bytes:
            raise SnapshotCorruptError(f"{path} is {size} bytes; its manifest implies {expected} and "
                                  f"{INDEX_NAME} says {record.bytes}")
        if self._read_range(info, manifest.data_file, 0, len(header)) != header:
            raise SnapshotCorruptError(f"{path}: safetensors header does not match its manifest")

    def read_tensor(self, info: SnapshotInfo, manifest: RankManifest, tensor: TensorRecord) -> bytes:
        """One tensor's bytes, checked against its crc32 (SnapshotCorruptError names file and tensor)."""
        data = self._read_range(info, manifest.data_file, manifest.data_start + tensor.data_offsets[0], tensor.nbytes)
        if len(data) != tensor.nbytes or crc32(data) != tensor.crc32:
            raise SnapshotCorruptError(f"{info.path / manifest.data_file}: tensor {tensor.name!r} fails its checksum")
        return data

    def read_blocks(self, info: SnapshotInfo, name: str, block_bytes: int) -> Iterator[bytes]:
        """The file ``name`` from its start in blocks of ``block_bytes``, unchecked: for a copy
        into another tier, which checks the crc32 on the way (bounded memory)."""
        offset = 0
        while block := self._read_range(info, name, offset, block_bytes):
            yield block
            offset += len(block)

    def local_file(self, info: SnapshotInfo, name: str) -> pathlib.Path | None:
        """Where the snapshot's file ``name`` is on this host's filesystem, for a tier that has
        one (restore maps it); None: read through :meth:`_read_range` only."""
        return None

    def read_listed(self, info: SnapshotInfo, record: FileRecord) -> bytes:
        """A small file the index lists, whole: its size checked before it is read (a bad one
        may be huge), then its crc32."""
        size = self._size(info, record.name)
        if size != record.bytes:
            raise SnapshotCorruptError(f"{info.path / record.name} is {size} bytes, its index says {record.bytes}")
        raw = self._read_range(info, record.name, 0, size)
        if len(raw) != record.bytes or crc32(raw) != record.crc32:
            raise SnapshotCorruptError(f"{info.path / record.name} does not match its checksum in {INDEX_NAME}")
        return raw


def _rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``[0-2, 5]``; ``[2, 3]`` stays ``[2, 3]``."""
    parts: list[str] = []
    for _, group in itertools.groupby(enumerate(ranks), lambda item: item[1] - item[0]):
        run = [rank for _, rank in group]
        parts.extend([f"{run[0]}-{run[-1]}"] if len(run) >= 3 else map(str, run))
    return "[" + ", ".join(parts) + "]"


@contextlib.contextmanager
def reading_file(path: object) -> Iterator[None]:
    """A missing file is SnapshotCorruptError, any other failure to read it SnapshotError."""
    try:
        yield
    except FileNotFoundError:
        raise SnapshotCorruptError(f"{path} is missing") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from None
