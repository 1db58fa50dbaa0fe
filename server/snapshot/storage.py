"""The storage seam of snapshots: *where* a snapshot's files go, apart from *what* they hold.

What a snapshot writes (the plan: file names, the safetensors header, tensors at byte ranges,
crc32s, manifests, ``snapshot.json``) is decided by the writer, its
:mod:`~swap_state.server.snapshot.plan` and :mod:`swap_state.common.snapshot_format`; how the
bytes reach a durable place, and how a finished snapshot is published atomically, is a
:class:`SnapshotStorage`'s. Modelled on ``torch.distributed.checkpoint``'s
``StorageWriter``/``StorageReader``: the callers only ever hand it names and bytes (or a file
descriptor to ``pwrite`` into), never build paths or call ``os`` for snapshot files.

:class:`~swap_state.server.snapshot.local_storage.LocalFilesystemStorage` is today's
(``--snapshot-dir``); an object store or a shared filesystem goes behind the same methods.

Call order (the coordinator, its store and the rank writers)::

    storage.create_root(); alone = storage.hold()         # once, at server start
    if alone: storage.clean_stale()                        # what a killed server left
    # one snapshot of (job, step):
    storage.step_state(job, step)                          # refuse, or replace what is there
    partial = storage.open_partial(job, step)              # empty; never listed
    with storage.create_file(partial, data_name) as file:  # per rank: its data file
        direct_fd = file.open_direct()                     # O_DIRECT where it can (else None)
        file.pwrite(header, 0)                             # or aligned writes on direct_fd
        pwrite_all(file.fileno(), view_of_segment, offset) # zero copy from the mapped segment
        file.fsync()
    storage.write_durable(partial, manifest_name, raw)     # per rank; then snapshot.json
    storage.seal(partial)                                  # every name in it durable
    published = storage.commit(partial, job, step, replace=...)  # atomic: complete from here
    storage.set_latest(job, step)
    for step, where in storage.list(job)[:-keep]: trash.append(storage.unlist(where))  # retention
    # the snapshot is reported durable here; then, off that path, the bytes go:
    storage.discard(published.replaced); for t in trash: storage.discard(t)
    # a failed snapshot instead: storage.discard(partial)
    storage.release()                                      # at shutdown

Errors: I/O failures raise ``OSError`` (the caller maps them to snapshot errors naming
:attr:`SnapshotStorage.root`: disk full becomes SnapshotDiskFull); a job id or location that
would leave the root raises SnapshotInvalid; :meth:`SnapshotStorage.commit` raises
SnapshotExists when the step is there already and ``replace`` is False.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import os
import pathlib
from types import TracebackType

__all__ = ["Published", "SnapshotFile", "SnapshotStorage", "StepState", "pwrite_all"]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``data`` is at ``offset`` (it may write short). Releases
    the GIL for the copy into the page cache."""
    done = 0
    total = data.nbytes
    while done < total:
        if done:
            with data[done:] as rest:
                done += os.pwrite(fd, rest, offset + done)
        else:
            done += os.pwrite(fd, data, offset)


class StepState(enum.Enum):
    """What a storage holds where a step's committed snapshot would go."""

    ABSENT = "absent"
    """Nothing: the step may be snapshotted."""
    COMPLETE = "complete"
    """A committed snapshot of that job and step."""
    OTHER = "other"
    """Something that is not a complete snapshot (never ours to touch)."""


@dataclasses.dataclass(frozen=True)
class Published:
    """What :meth:`SnapshotStorage.commit` did."""

    path: pathlib.PurePath
    """Where the committed snapshot is."""
    replaced: pathlib.PurePath | None
    """An earlier snapshot of the step, moved out of the way (unlisted) for :meth:`~SnapshotStorage.discard`."""
    warnings: tuple[str, ...]
    """Failures after the snapshot became complete (reported, not fatal)."""


class SnapshotFile(abc.ABC):
    """One new file of a partial snapshot, open for writing.

    Call order: :meth:`pwrite` (and ``os.pwrite`` on :meth:`fileno`) at any offsets, any
    order; :meth:`start_writeback` hints as bytes accumulate; :meth:`fsync`; :meth:`close`
    (on every path: use it as a context manager). Its bytes are durable once :meth:`fsync`
    returned, and part of the snapshot once the partial is committed.
    """

    @abc.abstractmethod
    def fileno(self) -> int:
        """An OS file descriptor open for writing that takes ``os.pwrite``: the writer copies
        from the mapped segment into it without a copy of its own (a remote storage spools
        here and uploads at :meth:`fsync`)."""

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        """All of ``data`` at ``offset``."""
        with memoryview(data) as view:
            pwrite_all(self.fileno(), view, offset)

    def open_direct(self) -> int | None:
        """A second descriptor of this file, open for writing with ``O_DIRECT`` (the caller
        writes block-aligned ranges from aligned memory through it, and closes it), or None
        where the storage or its filesystem does not take direct I/O. Default: None."""
        return None

    def start_writeback(self, offset: int, nbytes: int) -> None:
        """A hint: bytes ``[offset, offset + nbytes)`` are final, start moving them to the
        durable medium now (so :meth:`fsync` finds little left). Default: nothing."""

    @abc.abstractmethod
    def fsync(self) -> None:
        """Make every byte written so far durable."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the descriptor (idempotent); does not make anything durable."""

    def __enter__(self) -> SnapshotFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


class SnapshotStorage(abc.ABC):
    """Where snapshot files go; see the module docstring for the call order. Thread-safe for
    different snapshots; the store serialises commits (latest and retention read a job's
    snapshots)."""

    root: pathlib.PurePath
    """The storage's root, as messages name it (``--snapshot-dir``)."""

    # ---------------------------------------------------------------- once per server

    @abc.abstractmethod
    def create_root(self) -> None:
        """Create the root if it is missing."""

    @abc.abstractmethod
    def hold(self) -> bool:
        """Take this server's share of the root until :meth:`release`. True when no other
        live server shares it: only then may :meth:`clean_stale` run."""

    @abc.abstractmethod
    def clean_stale(self) -> list[pathlib.PurePath]:
        """Remove what a killed writer left (partial snapshots, half-removed ones, a pointer's
        temporary); returns what was removed."""

    @abc.abstractmethod
    def release(self) -> None:
        """Drop the share :meth:`hold` took."""

    # ---------------------------------------------------------------- writing a snapshot

    @abc.abstractmethod
    def location(self, job_id: str, step: int | None = None) -> pathlib.PurePath:
        """Where a job's snapshots are, or where the committed snapshot of ``step`` goes (for
        messages and statuses). SnapshotInvalid for a job id that would leave the root."""

    @abc.abstractmethod
    def step_state(self, job_id: str, step: int) -> StepState:
        """What is where the committed snapshot of ``step`` would go."""

    @abc.abstractmethod
    def open_partial(self, job_id: str, step: int) -> pathlib.PurePath:
        """A fresh, empty partial snapshot of ``step`` (a stale one is replaced); never listed."""

    @abc.abstractmethod
    def create_file(self, partial: pathlib.PurePath, name: str) -> SnapshotFile:
        """A new file ``name`` in ``partial`` (it must not exist), open for writing."""

    @abc.abstractmethod
    def write_durable(self, partial: pathlib.PurePath, name: str, data: bytes) -> None:
        """Create ``name`` in ``partial`` (it must not exist) with ``data``, durable on return."""

    @abc.abstractmethod
    def seal(self, partial: pathlib.PurePath) -> None:
        """Make every file name created in ``partial`` durable (before :meth:`commit`)."""

    @abc.abstractmethod
    def commit(self, partial: pathlib.PurePath, job_id: str, step: int, *, replace: bool) -> Published:
        """Publish ``partial`` as the snapshot of ``step``, atomically, durable on return.
        A committed snapshot of the step is moved out of the way first when ``replace``
        (returned in :attr:`Published.replaced`), else SnapshotExists. OSError before the
        publication leaves nothing half done; failures after it are warnings."""

    @abc.abstractmethod
    def set_latest(self, job_id: str, step: int) -> None:
        """Point the job's ``latest`` at ``step``. On failure the pointer is removed (best
        effort: ``latest`` then falls back to the highest step) and the OSError raised."""

    @abc.abstractmethod
    def discard(self, where: pathlib.PurePath) -> bool:
        """Remove an unlisted location (a failed partial, a replaced snapshot), best effort;
        True when it is gone."""

    # ---------------------------------------------------------------- committed snapshots

    @abc.abstractmethod
    def list(self, job_id: str) -> list[tuple[int, pathlib.PurePath]]:
        """The job's committed snapshots as (step, location), lowest step first; nothing
        partial, replaced or being removed."""

    @abc.abstractmethod
    def unlist(self, where: pathlib.PurePath) -> pathlib.PurePath:
        """Take a committed snapshot out of the listing, atomically and durably (retention's
        first half); returns where its bytes now are, for :meth:`discard`."""

    @abc.abstractmethod
    def remove(self, where: pathlib.PurePath) -> None:
        """Remove a committed snapshot: :meth:`unlist`, then delete (OSError on failure)."""
