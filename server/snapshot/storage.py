"""Where a snapshot's files go, apart from what they hold: :class:`SnapshotStorage`, the
``--snapshot-dir`` directory's file operations. Callers hand it names and bytes (or write
through a :class:`SnapshotFile`), never build paths (modelled on DCP's ``StorageWriter``).

Directory layout under the root::

    <root>/<job_id>/step-<N:012d>/          complete snapshots (snapshot.json present)
    <root>/<job_id>/.partial-step-<N:012d>/ a snapshot being written (never listed)
    <root>/<job_id>/.deleting-step-<N>/     an old snapshot being removed by retention
    <root>/<job_id>/latest                  "step-<N:012d>": the last committed snapshot
    <root>/.swap-state.lock                 a shared flock per live server

Call order: ``create_root``, ``hold``, ``clean_stale`` (when alone) at server start; per
snapshot ``step_state``, ``open_partial``, ``create_file``/``write_durable`` per rank, ``seal``,
``commit`` (atomic: complete from here), ``set_latest``, retention's ``unlist``, then off the
durability path ``discard``; ``release`` at shutdown.

Durability: a file is fsynced before it counts, a directory after names change in it;
publication is a ``rename`` of the partial directory, removal a ``rename`` out of the listed
names first: a directory removed halfway never looks complete. Every path is confined under
the root. I/O failures raise ``OSError``; a path leaving the root SnapshotInvalid.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import fcntl
import os
import pathlib
import shutil
import time

from swap_state.common.names import snapshot_id_for, step_dir_name
from swap_state.common.object_store import fsync_dir
from swap_state.common.snapshot_errors import SnapshotExists
from swap_state.common.snapshot_format import LATEST_NAME, partial_dir_name
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.server import _posix

__all__ = ["LOCK_NAME", "Published", "SnapshotFile", "SnapshotStorage", "StepState", "fsync_dir", "pwrite_all",
           "write_durable"]

LOCK_NAME = ".swap-state.lock"
FILE_MODE = 0o600
DIR_MODE = 0o700
"""Snapshots, their job directories and the lock are the server user's alone, whatever the
umask or the root directory's mode (a shared /snapshots, a hostPath)."""
_DELETING_PREFIX = ".deleting-"
_LATEST_TMP = ".latest.tmp"


def write_durable(path: pathlib.Path, data: bytes) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it."""
    with SnapshotFile(path, direct=False) as file:
        file.pwrite(data, 0)
        file.fsync()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``data`` is at ``offset`` (it may write short); releases the GIL."""
    done = 0
    while done < data.nbytes:
        with data[done:] as rest:
            done += os.pwrite(fd, rest, offset + done)


class StepState(enum.Enum):
    """What a storage holds where a step's committed snapshot would go."""

    ABSENT = "absent"
    COMPLETE = "complete"
    OTHER = "other"
    """Something that is not a complete snapshot (never ours to touch)."""


@dataclasses.dataclass(frozen=True)
class Published:
    """What :meth:`SnapshotStorage.commit` did."""

    path: pathlib.PurePath
    replaced: pathlib.PurePath | None
    """An earlier snapshot of the step, moved out of the way (unlisted) for :meth:`~SnapshotStorage.discard`."""
    warnings: tuple[str, ...]
    """Failures after the snapshot became complete (reported, not fatal)."""


class SnapshotFile:
    """One new file of a partial snapshot directory (``O_EXCL``), open for writing; a context
    manager. Its bytes are durable once :meth:`fsync` returned."""

    def __init__(self, path: pathlib.Path, direct: bool = True):
        """``direct``: :meth:`open_direct` may give an O_DIRECT descriptor (``--direct-io``)."""
        self.path = path
        self.direct = direct
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)

    def fileno(self) -> int:
        """The descriptor open for writing."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        return self._fd

    def open_direct(self) -> int | None:
        """A second descriptor of this file with ``O_DIRECT`` (the caller closes it); None where
        ``--direct-io`` or the filesystem refuses it (EINVAL: tmpfs, some network filesystems)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag or not self.direct:
            return None
        try:
            return os.open(self.path, os.O_WRONLY | flag | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None
            raise

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        """All of ``data`` at ``offset``."""
        with memoryview(data) as view:
            pwrite_all(self.fileno(), view, offset)

    def start_writeback(self, offset: int, nbytes: int) -> None:
        # sync_file_range: the kernel starts writing these pages now, so the fsync at the end
        # finds little left and the dirty pages of a big snapshot do not pile up.
        _posix.start_writeback(self.fileno(), offset, nbytes)

    def fsync(self) -> None:
        os.fsync(self.fileno())

    def close(self) -> None:
        """Release the descriptor (idempotent); does not make anything durable."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SnapshotFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SnapshotStorage:
    """A snapshot root directory on a filesystem with POSIX rename and fsync. Thread-safe for
    different snapshots; :class:`~.directory.SnapshotDirectory` serialises commits."""

    def __init__(self, root: str | os.PathLike[str], direct_io: str = "writes"):
        """``direct_io``: ``--direct-io`` (writes, off): whether snapshot writes may use O_DIRECT."""
        self.direct_writes = direct_io == "writes"
        # The reader's path rules (job ids, confinement, what is complete): one copy.
        self._reader = SnapshotReader(root)
        self.root: pathlib.Path = self._reader.root
        self._lock_fd: int | None = None

    def create_root(self) -> None:
        """Create the root if it is missing."""
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
        """Drop the share :meth:`hold` took."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the file releases the lock

    def clean_stale(self) -> None:
        """Remove ``.partial-*``, ``.deleting-*`` and the latest pointer's temp file of every job."""
        for job in self._reader.jobs():
            job_dir = self._reader.job_dir(job)
            for name in os.listdir(job_dir):
                path = job_dir / name
                if name.startswith((".partial-", _DELETING_PREFIX)) and path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif name == _LATEST_TMP:
                    path.unlink(missing_ok=True)

    def location(self, job_id: str, step: int | None = None) -> pathlib.Path:
        """Where a job's snapshots are, or where the committed ``step`` goes; SnapshotInvalid
        for a job id that would leave the root."""
        if step is None:
            return self._reader.job_dir(job_id)
        return self._reader.final_dir(job_id, step)

    def step_state(self, job_id: str, step: int) -> StepState:
        """What is where the committed snapshot of ``step`` would go."""
        final = self._reader.final_dir(job_id, step)
        if self._reader.load_index(job_id, final, step) is not None:
            return StepState.COMPLETE
        if os.path.lexists(final):
            return StepState.OTHER
        return StepState.ABSENT

    def open_partial(self, job_id: str, step: int) -> pathlib.Path:
        """A fresh, empty partial snapshot of ``step`` (a stale one is replaced); never listed."""
        partial = self._reader.job_dir(job_id) / partial_dir_name(step)
        partial.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self._reader.job_dir(job_id)  # re-check confinement now that it exists
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(mode=DIR_MODE)
        return partial

    def create_file(self, partial: pathlib.PurePath, name: str) -> SnapshotFile:
        """A new file ``name`` in ``partial`` (it must not exist), open for writing."""
        return SnapshotFile(self._inside(partial) / name, direct=self.direct_writes)

    def write_durable(self, partial: pathlib.PurePath, name: str, data: bytes) -> None:
        """Create ``name`` in ``partial`` (it must not exist) with ``data``, durable on return."""
        write_durable(self._inside(partial) / name, data)

    def seal(self, partial: pathlib.PurePath) -> None:
        """Make every file name created in ``partial`` durable (before :meth:`commit`)."""
        fsync_dir(self._inside(partial))

    def commit(self, partial: pathlib.PurePath, job_id: str, step: int, *, replace: bool) -> Published:
        """Rename the partial directory to ``step-<N>`` (an existing one renamed out of the way
        first: between the renames the step is absent, never mixed), fsync the job directory.
        Without ``replace`` a committed step raises SnapshotExists; failures after the rename
        are warnings."""
        job_dir = self._reader.job_dir(job_id)
        final = job_dir / step_dir_name(step)
        replaced = None
        if final.exists():
            if not replace:
                raise SnapshotExists(f"snapshot {snapshot_id_for(job_id, step)} already exists at {final}")
            replaced = final.with_name(_DELETING_PREFIX + final.name + f".{os.getpid()}")
            os.rename(final, replaced)
        os.rename(self._inside(partial), final)
        # From here on the snapshot is complete: what fails now is reported, not fatal.
        warnings: list[str] = []
        try:
            fsync_dir(job_dir)
        except OSError as exc:
            warnings.append(f"could not fsync {job_dir} after the rename: {exc}")
        return Published(final, replaced, tuple(warnings))

    def set_latest(self, job_id: str, step: int) -> None:
        """Write the pointer aside, fsync it, rename it over ``latest``, fsync the job dir; on
        failure remove the pointer (``latest`` falls back to the highest step) and raise."""
        job_dir = self._reader.job_dir(job_id)
        try:
            tmp = job_dir / _LATEST_TMP
            tmp.unlink(missing_ok=True)
            write_durable(tmp, (step_dir_name(step) + "\n").encode())
            os.replace(tmp, job_dir / LATEST_NAME)
            fsync_dir(job_dir)
        except OSError:
            # A stale pointer would hide the new snapshot.
            try:
                (job_dir / LATEST_NAME).unlink(missing_ok=True)
            except OSError:
                pass
            raise

    def discard(self, where: pathlib.PurePath) -> bool:
        """Remove an unlisted location (a failed partial, a replaced snapshot), best effort;
        True when it is gone."""
        path = self._inside(where)
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()

    def list(self, job_id: str) -> list[tuple[int, pathlib.PurePath]]:
        """The job's committed snapshots as (step, location), lowest step first."""
        return [(step, path) for step, path, _ in self._reader.complete(job_id)]

    def unlist(self, where: pathlib.PurePath) -> pathlib.Path:
        """Rename to ``.deleting-step-<N>.<unique>`` and fsync the job directory: unlisted,
        durably, before any byte is removed."""
        path = self._inside(where)
        trash = path.with_name(f"{_DELETING_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}")
        os.rename(path, trash)
        fsync_dir(path.parent)
        return trash

    def remove(self, where: pathlib.PurePath) -> None:
        """Remove a committed snapshot: :meth:`unlist`, then delete (OSError on failure)."""
        shutil.rmtree(self.unlist(where))

    def _inside(self, where: pathlib.PurePath) -> pathlib.Path:
        """``where`` as a path, refused unless it is under the root."""
        path = pathlib.Path(where)
        if self.root not in path.parents:
            raise ValueError(f"{where} is not inside the snapshot directory {self.root}")
        return path
