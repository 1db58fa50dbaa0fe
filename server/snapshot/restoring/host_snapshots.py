"""What this host can read of each step, for Restore and ``latest``: its ``--snapshot-dir``, the replicas peers sent it
(``--replica-listen``) and its peers' (``--replica-peers``), one snapshot per step with the ranks of all (each rank from
the first that holds it; a copy of another attempt or tenant is not mixed in). So a lost host's ranks come back from a
peer's memory beside the ranks on disk, at any world size, and ``latest`` is the newest step complete for the whole job
(else the newest step)."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

from swap_state.common.names import parse_snapshot_id
from swap_state.common.snapshot_errors import SnapshotCorruptError, SnapshotInvalid, SnapshotNotFoundError
from swap_state.common.snapshot_format import rank_data_name
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier

__all__ = ["HostSnapshots"]

_REMEMBERED = 1024  # merged snapshots whose files' places are kept (a restore resolves, then reads)


class HostSnapshots(SnapshotTier):
    """Several local directories read as one tier (the seam's call order)."""

    where = "local"

    def __init__(self, parts: Sequence[SnapshotTier]):
        """``parts``: this host's directory first, then its replicas, then its peers' (each read in turn)."""
        self.parts = tuple(parts)
        self.root = self.parts[0].root
        self._files: dict[str, dict[str, tuple[SnapshotTier, SnapshotInfo]]] = {}  # merged id -> file -> its part

    def list(self, job_id: str | None = None) -> list[SnapshotInfo]:
        found: dict[tuple[str, int], list[tuple[SnapshotTier, SnapshotInfo]]] = {}
        for part in self.parts:
            for info in part.list(job_id):
                found.setdefault((info.job_id, info.step), []).append((part, info))
        merged = [self._merge(infos) for _, infos in sorted(found.items())]
        newest = {info.job_id: info.step for info in merged}  # ascending: the last one stays
        latest = {**newest, **{info.job_id: info.step for info in merged if info.index.complete_job}}
        return [dataclasses.replace(info, latest=latest[info.job_id] == info.step) for info in merged]

    def _merge(self, infos: list[tuple[SnapshotTier, SnapshotInfo]]) -> SnapshotInfo:
        """One step's parts as one snapshot: each rank from the first part holding it."""
        first = infos[0][1]
        files, ranks, layout = {}, set(), None
        for part, info in infos:
            if (info.index.attempt, info.index.tenant, info.world_size) != (
                    first.index.attempt, first.index.tenant, first.world_size):
                continue  # another attempt at the step, or not the same job's: never mixed
            new = set(info.ranks) - ranks
            ranks |= new
            files.update({record.name: (record, part, info) for record in info.index.files if record.rank in new})
            if layout is None and info.index.layout is not None:
                layout = info.index.layout
                files[layout.name] = (layout, part, info)
        index = dataclasses.replace(first.index, ranks=tuple(sorted(ranks)), layout=layout,
                                    files=tuple(record for record, _, _ in files.values() if record.rank >= 0))
        self._files[first.snapshot_id] = {name: (part, info) for name, (_, part, info) in files.items()}
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

    def _part(self, info: SnapshotInfo, name: str) -> tuple[SnapshotTier, SnapshotInfo]:
        found = self._files.get(info.snapshot_id, {}).get(name)
        if found is None:
            raise SnapshotCorruptError(f"{info.snapshot_id} as listed here has no file {name}")
        return found

    def places(self, info: SnapshotInfo, ranks: Sequence[int]) -> list[str]:
        """The distinct places (this host's directory, memory, replicas, a peer) the ranks' data come from."""
        held = self._files.get(info.snapshot_id, {})
        return sorted({str(held[name][1].path) for rank in ranks if (name := rank_data_name(rank)) in held})

    def local_file(self, info: SnapshotInfo, name: str) -> pathlib.Path | None:
        part, part_info = self._part(info, name)
        return part.local_file(part_info, name)

    def _size(self, info: SnapshotInfo, name: str) -> int:
        part, part_info = self._part(info, name)
        return part.size(part_info, name)

    def _read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        part, part_info = self._part(info, name)
        return part.read_range(part_info, name, offset, nbytes)
