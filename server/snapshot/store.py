"""Snapshots on disk, the writing side: the commit sequence, retention and stale cleanup.

Directory layout under the snapshot root (``--snapshot-dir``)::

    <root>/<job_id>/step-<N:012d>/          complete snapshots (snapshot.json present)
    <root>/<job_id>/.partial-step-<N:012d>/ a snapshot being written (never listed)
    <root>/<job_id>/.deleting-step-<N>/     an old snapshot being removed by retention
    <root>/<job_id>/latest                  "step-<N:012d>": the last committed snapshot

Reading (list, resolve, manifests, verify) is :class:`~swap_state.common.snapshot_reader.SnapshotReader`'s,
which this store extends.

Writing (the coordinator, in this order): :meth:`~SnapshotStore.clean_stale` once at start,
:meth:`~SnapshotStore.prepare_partial` per snapshot, the ranks' files, then
:meth:`~SnapshotStore.commit` (index, fsync, atomic rename, ``latest``, retention) or
:meth:`~SnapshotStore.discard` on failure. Every path is built here and confined under the root.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pathlib
import shutil
import threading

from swap_state.common.names import snapshot_id_for, step_dir_name
from swap_state.common.snapshot_errors import SnapshotExists, from_os_error
from swap_state.common.snapshot_format import INDEX_NAME, LATEST_NAME, SnapshotIndex, dumps_json, partial_dir_name
from swap_state.common.snapshot_reader import SnapshotInfo, SnapshotReader

__all__ = ["SnapshotInfo", "CommitResult", "SnapshotStore", "fsync_dir", "write_durable"]

LOCK_NAME = ".swap-state.lock"
_DELETING_PREFIX = ".deleting-"
_LATEST_TMP = ".latest.tmp"


def fsync_dir(path: pathlib.Path) -> None:
    """Make the directory's entries (created, renamed, removed names) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: pathlib.Path, data: bytes) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class CommitResult:
    """What :meth:`SnapshotStore.commit` did."""

    path: pathlib.Path
    """The complete snapshot's directory."""
    deleted: tuple[str, ...]
    """Snapshot ids retention removed."""
    warnings: tuple[str, ...]
    """Failures after the snapshot was durable (latest pointer, retention): reported, not fatal."""


class SnapshotStore(SnapshotReader):
    """The snapshot root directory, read and written by the server. Thread-safe."""

    def __init__(self, root: str | os.PathLike[str]):
        super().__init__(root)
        # Commits of different snapshots serialize here: latest and retention read the job dir.
        self._commit_lock = threading.Lock()
        self._lock_fd: int | None = None

    def partial_dir(self, job_id: str, step: int) -> pathlib.Path:
        return self.job_dir(job_id) / partial_dir_name(step)

    def hold(self) -> bool:
        """Take this server's share of the root (a shared ``flock`` on ``.swap-state.lock``,
        held until :meth:`release`). True when no other live server shares the directory
        (an exclusive lock was free first): only then may :meth:`clean_stale` run, since the
        partial snapshots of another live server are not stale (two embedded servers may share
        the per-user default directory)."""
        self._lock_fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # converts an exclusive lock, or waits for one
        return alone

    def release(self) -> None:
        """Drop the share :meth:`hold` took (closing the file releases the lock)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def clean_stale(self) -> list[pathlib.Path]:
        """Remove what a killed writer left behind (``.partial-*``, ``.deleting-*``, the
        latest pointer's temp file). Call once at server start, before any snapshot, and only
        when :meth:`hold` says no other live server shares the directory."""
        removed = []
        for job in self.jobs():
            job_dir = self.job_dir(job)
            for name in os.listdir(job_dir):
                path = job_dir / name
                if name.startswith((".partial-", _DELETING_PREFIX)) and path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                elif name == _LATEST_TMP:
                    path.unlink(missing_ok=True)
                    removed.append(path)
        return removed

    def prepare_partial(self, job_id: str, step: int, replace: bool = False) -> pathlib.Path:
        """Create an empty ``.partial-step-<N>`` (replacing a stale one). SnapshotExists when
        that step is already complete, unless ``replace`` (then :meth:`commit` replaces it)."""
        final = self.final_dir(job_id, step)
        if self._load_index(job_id, final, step) is not None:
            if not replace:
                raise SnapshotExists(
                    f"snapshot {snapshot_id_for(job_id, step)} already exists at {final}, from an "
                    "earlier attempt at that step: use a new job id, or let the snapshot replace "
                    "it (SnapshotRequest.replace_existing; torchtitan's glue does)"
                )
            return self._fresh_partial(job_id, step)
        if os.path.lexists(final):
            # Not ours (we only ever rename complete snapshots there): refuse to touch it.
            raise SnapshotExists(f"{final} exists but is not a complete snapshot; remove it to snapshot step {step}")
        return self._fresh_partial(job_id, step)

    def _fresh_partial(self, job_id: str, step: int) -> pathlib.Path:
        partial = self.partial_dir(job_id, step)
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            self.job_dir(job_id)  # re-check confinement now that it exists
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        except OSError as exc:
            raise from_os_error(exc, f"creating {partial.name}", partial.parent) from None
        return partial

    def discard(self, partial: pathlib.Path) -> None:
        """Remove a failed snapshot's partial directory (best effort; clean_stale retries)."""
        shutil.rmtree(partial, ignore_errors=True)

    def commit(
        self, partial: pathlib.Path, index: SnapshotIndex, keep_latest: int | None, replace: bool = False
    ) -> CommitResult:
        """Publish a partial snapshot whose rank files are written and fsynced: write
        ``snapshot.json``, fsync it and the directory, rename to ``step-<N>``, fsync the job
        directory, point ``latest`` at it, then apply retention (keep the ``keep_latest``
        highest steps, never the new one; None keeps all). OSError before the rename is the
        caller's to map; failures after it become warnings, the snapshot stays durable."""
        job_dir = self.job_dir(index.job_id)
        final = job_dir / step_dir_name(index.step)
        write_durable(partial / INDEX_NAME, dumps_json(index.to_json()))
        fsync_dir(partial)
        with self._commit_lock:
            replaced = None
            if final.exists():
                if not replace:
                    raise SnapshotExists(f"snapshot {index.snapshot_id} already exists at {final}")
                # Out of the way first, by rename: a directory removed halfway must not look
                # complete, and between the two renames the step is absent, never mixed.
                replaced = final.with_name(_DELETING_PREFIX + final.name + f".{os.getpid()}")
                os.rename(final, replaced)
            os.rename(partial, final)
            # From here on the snapshot is complete: what fails now is reported, not fatal.
            warnings: list[str] = []
            try:
                fsync_dir(job_dir)
            except OSError as exc:
                warnings.append(f"could not fsync {job_dir} after the rename: {exc}")
            try:
                self._point_latest(job_dir, final.name)
            except OSError as exc:
                # A stale pointer would hide the new snapshot; without one, latest falls back
                # to the highest step.
                try:
                    (job_dir / LATEST_NAME).unlink(missing_ok=True)
                except OSError:
                    pass
                warnings.append(f"could not update {job_dir / LATEST_NAME}: {exc}")
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
                if replaced.exists():
                    warnings.append(f"could not remove the replaced snapshot {replaced}")
            deleted: list[str] = []
            if keep_latest is not None:
                deleted = self._retain(index.job_id, index.step, keep_latest, warnings)
        return CommitResult(final, tuple(deleted), tuple(warnings))

    def _point_latest(self, job_dir: pathlib.Path, name: str) -> None:
        tmp = job_dir / _LATEST_TMP
        tmp.unlink(missing_ok=True)
        write_durable(tmp, (name + "\n").encode())
        os.replace(tmp, job_dir / LATEST_NAME)
        fsync_dir(job_dir)

    def _retain(self, job_id: str, new_step: int, keep: int, warnings: list[str]) -> list[str]:
        try:
            complete = self._complete(job_id)
        except OSError as exc:
            warnings.append(f"retention could not list {self.job_dir(job_id)}: {exc}")
            return []
        keep_steps = {step for step, _, _ in complete[-keep:]} | {new_step}
        deleted = []
        for step, path, _ in complete:
            if step in keep_steps:
                continue
            # Rename first: a directory removed halfway must not look complete.
            trash = path.with_name(_DELETING_PREFIX + path.name)
            try:
                os.rename(path, trash)
                fsync_dir(path.parent)
                shutil.rmtree(trash)
            except OSError as exc:
                warnings.append(f"retention could not remove {path}: {exc}")
                continue
            deleted.append(snapshot_id_for(job_id, step))
        return deleted
