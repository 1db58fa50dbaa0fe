"""A snapshot directory (``--snapshot-dir``) read only, one tier (:class:`~.snapshot_tier.SnapshotTier`)::

    <root>/<job_id>/step-<N:012d>/          complete snapshots (snapshot.json present)
    <root>/<job_id>/.partial-step-<N:012d>/ a snapshot being written (never listed)
    <root>/<job_id>/.deleting-step-<N>/     an old snapshot being removed by retention
    <root>/<job_id>/latest                  "step-<N:012d>": the last committed snapshot

A directory is listed only when its ``snapshot.json`` parses and names the same job and step,
so a half-written snapshot is never listed or loaded; the writer publishes by atomic rename.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from .names import is_job_id, parse_snapshot_id, parse_step_dir_name, validate_job_id
from .object_store import read_range
from .snapshot_errors import SnapshotInvalid, SnapshotNotFoundError
from .snapshot_format import INDEX_NAME, LATEST_NAME, SnapshotIndex
from .snapshot_tier import SnapshotInfo, SnapshotTier, reading_file

__all__ = ["SnapshotReader"]

_ELSEWHERE = ("was it taken by another server (another host, or an embedded server with its own snapshot "
              "directory) or with another --snapshot-dir? Point the server (or swap-state export "
              "--snapshot-dir) at that directory")


class SnapshotReader(SnapshotTier):
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
        try:
            return SnapshotIndex.parse((path / INDEX_NAME).read_bytes(), job_id, step)
        except OSError:
            return None

    def complete(self, job_id: str) -> list[tuple[int, pathlib.Path, SnapshotIndex]]:
        job_dir = self.job_dir(job_id)
        try:
            names = os.listdir(job_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        steps = sorted(((step, job_dir / name) for name in names if (step := parse_step_dir_name(name)) is not None),
                       key=lambda item: item[0])
        return [(step, path, index) for step, path in steps if (index := self.load_index(job_id, path, step))]

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
            raise SnapshotNotFoundError(f"job {job!r} has no complete snapshot in {self.root}: {_ELSEWHERE}")
        raise SnapshotNotFoundError(f"no complete snapshot {ref} in {self.root}: "
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
