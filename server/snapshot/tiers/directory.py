"""The server's ``--snapshot-dir``: :class:`SnapshotDirectory`, the local tier's writer (the
:class:`~.seam.TierWriter` seam) and its retention; reading is its :attr:`~SnapshotDirectory.reader`'s.
Call order: ``create_root``, ``hold``, ``clean_stale`` (when alone) at start; per snapshot the seam's,
then ``empty_trash`` off the durability path (``discard`` on failure); ``release`` at shutdown.
Commit rule: every file fsynced, the partial directory fsynced and renamed to ``step-<N>``, then
``latest``; removal renames out of the listed names first, so nothing removed halfway looks complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable

from swap_state.common.names import snapshot_id_for, step_dir_name
from swap_state.common.object_store import fsync_dir
from swap_state.common.server_config import DirectIO, SnapshotSettings
from swap_state.common.snapshot_errors import SnapshotExistsError, from_os_error
from swap_state.common.snapshot_format import (
    INDEX_NAME, LATEST_NAME, LAYOUT_NAME, FileRecord, SnapshotIndex, dumps_json, partial_dir_name)
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.server.snapshot.tiers.seam import CommitResult, StepPlan, StepWrite, TierWriter
from swap_state.server.snapshot.tiers.spares import SpareFiles
from swap_state.server.snapshot.writing.sink import ChunkSink, open_sink
from swap_state.server.snapshot.writing.snapshot_file import DIR_MODE, FILE_MODE, SnapshotFile, write_durable

__all__ = ["SnapshotDirectory", "LOCK_NAME"]

LOCK_NAME = ".swap-state.lock"
_DELETING_PREFIX = ".deleting-"
_LATEST_TMP = ".latest.tmp"


class SnapshotDirectory(TierWriter):
    """The snapshot root (POSIX rename and fsync). Thread-safe for different snapshots; commits serialise."""

    def __init__(self, root: str | os.PathLike[str], direct_io: DirectIO = SnapshotSettings.direct_io):
        self.reader = SnapshotReader(root)  # the local tier: what this directory holds, read
        self.root = self.reader.root
        self.direct_writes = direct_io is DirectIO.WRITES
        # In memory (tmpfs): removed steps' data files, written over by new ones (set once created).
        self.spares: SpareFiles | None = None
        # The steps of a job retention must keep beyond ``keep_latest`` (the uploader's).
        self.in_use: Callable[[str], set[int]] = lambda job_id: set()
        # Commits of different snapshots serialize here: latest and retention read the job dir.
        self._commit_lock = threading.Lock()
        self._lock_fd: int | None = None

    def create_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def hold(self) -> bool:
        """A shared ``flock`` on ``.swap-state.lock`` until :meth:`release`; True when an exclusive
        one was free first (no other live server, whose partial snapshots are not stale)."""
        self._lock_fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # converts an exclusive lock, or waits for one
        return alone

    def release(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the file releases the share hold() took

    def clean_stale(self) -> None:
        """Remove ``.partial-*``, ``.deleting-*`` and the latest pointer's temp file of every job."""
        for job in self.reader.jobs():
            job_dir = self.reader.job_dir(job)
            for name in os.listdir(job_dir):
                path = job_dir / name
                if name.startswith((".partial-", _DELETING_PREFIX)) and path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif name == _LATEST_TMP:
                    path.unlink(missing_ok=True)

    def prepare(self, plan: StepPlan) -> StepWrite:
        """A fresh, empty partial snapshot of the step (a stale one is replaced); SnapshotExistsError
        when that step is already complete, unless ``plan.replace``."""
        job_id, step = plan.job_id, plan.step
        final = self.reader.job_dir(job_id) / step_dir_name(step)
        if self.reader.load_index(job_id, final, step) is not None:
            if not plan.replace:
                raise SnapshotExistsError(f"snapshot {snapshot_id_for(job_id, step)} already exists at {final}, from "
                                          "an earlier attempt at that step: use a new job id, or let the snapshot "
                                          "replace it (SnapshotRequest.replace_existing; torchtitan's glue does)")
        elif os.path.lexists(final):
            # Not ours (we only ever publish complete snapshots there): refuse to touch it.
            raise SnapshotExistsError(f"{final} exists but is not a complete snapshot; remove it to snapshot "
                                 f"step {step}")
        try:
            partial = self.reader.job_dir(job_id) / partial_dir_name(step)
            partial.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            self.reader.job_dir(job_id)  # re-check confinement now that it exists
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(mode=DIR_MODE)
            return StepWrite(plan, partial, plan.ranks)
        except OSError as exc:
            raise from_os_error(exc, f"creating {partial_dir_name(step)}", self.reader.job_dir(job_id)) from None

    def open_file(self, target: StepWrite, name: str) -> ChunkSink:
        """A new file ``name`` in the partial directory: O_DIRECT where ``--direct-io`` and the
        filesystem allow; in memory, a data file is a spare written over where there is one."""
        path = self._inside(target.location) / name
        spare = self.spares is not None and name.endswith(".safetensors") and self.spares.take(path)
        file = SnapshotFile(path, direct=self.direct_writes, spare=spare)
        if self.spares is not None:  # never a spare while written (another rank's failure discards the step)
            fcntl.flock(file.fileno(), fcntl.LOCK_SH)
        return open_sink(file, self.spares)

    def write_file(self, target: StepWrite, name: str, data: bytes) -> None:
        write_durable(self._inside(target.location) / name, data)

    def finish_rank(self, target: StepWrite, rank: int, files: tuple[FileRecord, ...]) -> None:
        """Nothing: a rank's files are fsynced as written and listed by the step's snapshot.json."""

    def finish(self, target: StepWrite, index: SnapshotIndex, layout: bytes | None) -> CommitResult:
        """The commit rule (module docstring): an existing step is renamed out of the way first when
        ``plan.replace`` (between the renames the step is absent, never mixed), then retention
        (its bytes go in :meth:`empty_trash`). OSError before the rename; warnings after it."""
        partial, keep_latest, replace = self._inside(target.location), target.plan.keep, target.plan.replace
        if layout is not None:
            write_durable(partial / LAYOUT_NAME, layout)
        write_durable(partial / INDEX_NAME, dumps_json(index.to_json()))
        fsync_dir(partial)  # every file name created in it is durable
        job_dir = self.reader.job_dir(index.job_id)
        final = job_dir / step_dir_name(index.step)
        with self._commit_lock:
            trash: list[pathlib.PurePath] = []
            if final.exists():
                if not replace:
                    raise SnapshotExistsError(f"snapshot {index.snapshot_id} already exists at {final}")
                trash.append(final.with_name(_DELETING_PREFIX + final.name + f".{os.getpid()}"))
                os.rename(final, trash[0])
            os.rename(partial, final)
            # From here on the snapshot is complete: what fails now is reported, not fatal.
            warnings: list[str] = []
            try:
                fsync_dir(job_dir)
            except OSError as exc:
                warnings.append(f"could not fsync {job_dir} after the rename: {exc}")
            try:
                self._set_latest(job_dir, index.step)
            except OSError as exc:
                warnings.append(f"could not update {job_dir / LATEST_NAME}: {exc}")
            if keep_latest is not None:
                self._retain(index.job_id, index.step, keep_latest, warnings, trash)
        return CommitResult(final, tuple(warnings), tuple(trash))

    def _set_latest(self, job_dir: pathlib.Path, step: int) -> None:
        """Write the pointer aside, fsync it, rename it over ``latest``, fsync the job dir; on
        failure remove the pointer (``latest`` falls back to the highest step) and raise."""
        try:
            tmp = job_dir / _LATEST_TMP
            tmp.unlink(missing_ok=True)
            write_durable(tmp, (step_dir_name(step) + "\n").encode())
            os.replace(tmp, job_dir / LATEST_NAME)
            fsync_dir(job_dir)
        except OSError:
            with contextlib.suppress(OSError):  # a stale pointer would hide the new snapshot
                (job_dir / LATEST_NAME).unlink(missing_ok=True)
            raise

    def discard(self, target: StepWrite) -> bool:
        return self._remove(target.location)

    def remove_step(self, info: SnapshotInfo) -> bool:
        """Unlist a complete step (renamed out of the listed names first), then remove its bytes;
        True when gone. Not a job's newest step: ``latest`` may name it."""
        with self._commit_lock:
            unlisted = info.path.with_name(f"{_DELETING_PREFIX}{info.path.name}.{os.getpid()}.{time.monotonic_ns()}")
            os.rename(info.path, unlisted)
        return self._remove(unlisted)

    def _remove(self, where: pathlib.PurePath) -> bool:
        """Remove an unlisted location, best effort; True when it is gone."""
        path = self._inside(where)
        if self.spares is not None:
            self.spares.keep(sorted(path.glob("*.safetensors")))
        shutil.rmtree(path, ignore_errors=True)
        if self.spares is not None:
            self.spares.unmap_removed()
        return not path.exists()

    def empty_trash(self, commit: CommitResult) -> list[str]:
        """Remove the bytes of what ``commit`` unlisted; warnings for what could not be removed."""
        return [f"could not remove {where} (unlisted; removed at the next server start)"
                for where in commit.trash if not self._remove(where)]

    def _retain(self, job_id: str, new_step: int, keep: int, warnings: list[str],
                trash: list[pathlib.PurePath]) -> None:
        """Unlist all but the ``keep`` highest steps (and the new one, and those in use) into
        ``trash`` (renamed, the job directory fsynced) before any byte is removed."""
        try:
            complete = self.reader.complete(job_id)
        except OSError as exc:
            warnings.append(f"retention could not list {self.reader.job_dir(job_id)}: {exc}")
            return
        keep_steps = {step for step, _, _ in complete[-keep:]} | {new_step} | self.in_use(job_id)
        for step, path, _ in complete:
            if step not in keep_steps:
                try:
                    unlisted = path.with_name(f"{_DELETING_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}")
                    os.rename(path, unlisted)
                    fsync_dir(path.parent)
                    trash.append(unlisted)
                except OSError as exc:
                    warnings.append(f"retention could not remove {path}: {exc}")

    def _inside(self, where: pathlib.PurePath) -> pathlib.Path:
        """``where`` as a path, refused unless it is under the root."""
        path = pathlib.Path(where)
        if self.root not in path.parents:
            raise ValueError(f"{where} is not inside the snapshot directory {self.root}")
        return path
