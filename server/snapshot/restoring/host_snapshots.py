"""What this host holds of each step, for Restore and ``latest``: its ``--snapshot-dir`` and the
replicas peers sent it (``--replica-listen``), one snapshot per step with the ranks of both
(the host's own first; a replica of another attempt or tenant is not mixed in). So a lost
host's ranks come back from this host's memory beside its own, at any world size, and
``latest`` is the newest step complete for the whole job here (else the newest step).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

from swap_state.common.names import parse_snapshot_id
from swap_state.common.object_store import read_range
from swap_state.common.snapshot_errors import SnapshotInvalid, SnapshotNotFoundError
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier, reading_file

__all__ = ["HostSnapshots"]

_REMEMBERED = 1024  # merged snapshots whose files' places are kept (a restore resolves, then reads)


class HostSnapshots(SnapshotTier):
    """Several local directories read as one tier (the seam's call order)."""

    where = "local"

    def __init__(self, parts: Sequence[SnapshotReader]):
        self.parts = tuple(parts)
        self.root = self.parts[0].root
        self._files: dict[str, dict[str, pathlib.Path]] = {}  # merged snapshot id -> file name -> path

    def list(self, job_id: str | None = None) -> list[SnapshotInfo]:
        found: dict[tuple[str, int], list[SnapshotInfo]] = {}
        for part in self.parts:
            for info in part.list(job_id):
                found.setdefault((info.job_id, info.step), []).append(info)
        merged = [self._merge(infos) for _, infos in sorted(found.items())]
        newest = {info.job_id: info.step for info in merged}  # ascending: the last one stays
        latest = {**newest, **{info.job_id: info.step for info in merged if info.index.complete_job}}
        return [dataclasses.replace(info, latest=latest[info.job_id] == info.step) for info in merged]

    def _merge(self, infos: list[SnapshotInfo]) -> SnapshotInfo:
        """One step's parts as one snapshot: each rank from the first part holding it."""
        first = infos[0]
        files, ranks, layout = {}, set(), first.index.layout
        for info in infos:
            if (info.index.attempt, info.index.tenant, info.world_size) != (
                    first.index.attempt, first.index.tenant, first.world_size):
                continue  # another attempt at the step, or not the same job's: never mixed
            new = set(info.ranks) - ranks
            ranks |= new
            files.update({record.name: (record, info.path / record.name) for record in info.index.files
                          if record.rank in new})
            if layout is None and info.index.layout is not None:
                layout = info.index.layout
                files[layout.name] = (layout, info.path / layout.name)
        index = dataclasses.replace(first.index, ranks=tuple(sorted(ranks)), layout=layout,
                                    files=tuple(record for record, _ in files.values() if record.rank >= 0))
        self._files[first.snapshot_id] = {name: path for name, (_, path) in files.items()}
        while len(self._files) > _REMEMBERED:
            del self._files[next(iter(self._files))]
        return SnapshotInfo.of(index, first.path)

    def resolve(self, snapshot_id: str, job_id: str | None = None) -> SnapshotInfo:
        ref = parse_snapshot_id(snapshot_id, job_id, SnapshotInvalid)
        snapshots = self.list(ref.job_id)
        found = next((i for i in snapshots if (i.latest if ref.latest else i.step == ref.step)), None)
        if found is None:
            where = " and ".join(str(part.root) for part in self.parts)
            raise SnapshotNotFoundError(f"no complete snapshot {ref} in {where} (this host's snapshots and the "
                                        f"replicas peers sent it); steps here: {[i.step for i in snapshots]}")
        return found

    def local_file(self, info: SnapshotInfo, name: str) -> pathlib.Path:
        path = self._files.get(info.snapshot_id, {}).get(name)
        return path if path is not None else info.path / name

    def _size(self, info: SnapshotInfo, name: str) -> int:
        path = self.local_file(info, name)
        with reading_file(path):
            return path.stat().st_size

    def _read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        path = self.local_file(info, name)
        with reading_file(path):
            return read_range(path, offset, nbytes)
