"""The server's ``--snapshot-dir``: the commit sequence and retention, over its storage.

Reading is :class:`~swap_state.common.snapshot_reader.SnapshotReader`'s, which this extends;
where the files go is its :class:`~.storage.SnapshotStorage`'s. Writing (the coordinator):
:meth:`~SnapshotDirectory.prepare_partial` per snapshot, the ranks' files, then
:meth:`~SnapshotDirectory.commit`, or the storage's ``discard`` on failure.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
from collections.abc import Callable

from swap_state.common.names import snapshot_id_for
from swap_state.common.snapshot_errors import SnapshotExists, from_os_error
from swap_state.common.snapshot_format import INDEX_NAME, LATEST_NAME, LAYOUT_NAME, SnapshotIndex, dumps_json, partial_dir_name
from swap_state.common.snapshot_reader import SnapshotInfo, SnapshotReader
from swap_state.server.snapshot.storage import SnapshotStorage, StepState

__all__ = ["SnapshotInfo", "CommitResult", "SnapshotDirectory"]


@dataclasses.dataclass(frozen=True)
class CommitResult:
    """What :meth:`SnapshotDirectory.commit` did."""

    path: pathlib.PurePath
    """The complete snapshot's location (its directory, on the local filesystem)."""
    warnings: tuple[str, ...]
    """Failures after the snapshot was durable (latest pointer, retention): reported, not fatal."""
    trash: tuple[pathlib.PurePath, ...] = ()
    """Unlisted locations whose bytes :meth:`SnapshotDirectory.empty_trash` removes once the
    snapshot was reported durable (deleting 512 MiB took 130 ms on ext4 here)."""


class SnapshotDirectory(SnapshotReader):
    """The snapshot root, read and written by the server. Thread-safe."""

    def __init__(self, root: str | os.PathLike[str], storage: SnapshotStorage | None = None):
        """``storage``: where the files go (default: the local directory ``root``)."""
        super().__init__(root)
        self.in_use: Callable[[str], set[int]] = lambda job_id: set()
        """The steps of a job retention must keep beyond ``keep_latest`` (the uploader's)."""
        self.storage: SnapshotStorage = storage if storage is not None else SnapshotStorage(self.root)
        # Commits of different snapshots serialize here: latest and retention read the job dir.
        self._commit_lock = threading.Lock()

    def prepare_partial(self, job_id: str, step: int, replace: bool = False) -> pathlib.PurePath:
        """An empty partial snapshot of ``step`` (replacing a stale one). SnapshotExists when
        that step is already complete, unless ``replace`` (then :meth:`commit` replaces it)."""
        state = self.storage.step_state(job_id, step)
        if state is StepState.COMPLETE and not replace:
            raise SnapshotExists(f"snapshot {snapshot_id_for(job_id, step)} already exists at "
                                 f"{self.storage.location(job_id, step)}, from an earlier attempt at that "
                                 "step: use a new job id, or let the snapshot replace it "
                                 "(SnapshotRequest.replace_existing; torchtitan's glue does)")
        if state is StepState.OTHER:
            # Not ours (we only ever publish complete snapshots there): refuse to touch it.
            raise SnapshotExists(f"{self.storage.location(job_id, step)} exists but is not a complete "
                                 f"snapshot; remove it to snapshot step {step}")
        try:
            return self.storage.open_partial(job_id, step)
        except OSError as exc:
            raise from_os_error(exc, f"creating {partial_dir_name(step)}", self.storage.location(job_id)) from None

    def commit(self, partial: pathlib.PurePath, index: SnapshotIndex, keep_latest: int | None,
               replace: bool = False, layout: bytes | None = None) -> CommitResult:
        """Publish a partial snapshot whose rank files are fsynced: write ``layout`` and
        ``snapshot.json`` durably, seal, publish atomically as ``step-<N>``, point ``latest`` at
        it, then retention (unlist all but the ``keep_latest`` highest steps; None keeps all;
        bytes go in :meth:`empty_trash`). OSError before the publication is the caller's to
        map; failures after it become warnings."""
        if layout is not None:
            self.storage.write_durable(partial, LAYOUT_NAME, layout)
        self.storage.write_durable(partial, INDEX_NAME, dumps_json(index.to_json()))
        self.storage.seal(partial)
        with self._commit_lock:
            published = self.storage.commit(partial, index.job_id, index.step, replace=replace)
            warnings = list(published.warnings)
            try:
                self.storage.set_latest(index.job_id, index.step)
            except OSError as exc:
                warnings.append(f"could not update {self.storage.location(index.job_id) / LATEST_NAME}: {exc}")
            trash: list[pathlib.PurePath] = [published.replaced] if published.replaced is not None else []
            if keep_latest is not None:
                self._retain(index.job_id, index.step, keep_latest, warnings, trash)
        return CommitResult(published.path, tuple(warnings), tuple(trash))

    def empty_trash(self, commit: CommitResult) -> list[str]:
        """Remove the bytes of what ``commit`` unlisted; warnings for what could not be removed."""
        return [f"could not remove {where} (unlisted; removed at the next server start)"
                for where in commit.trash if not self.storage.discard(where)]

    def _retain(self, job_id: str, new_step: int, keep: int, warnings: list[str],
                trash: list[pathlib.PurePath]) -> None:
        """Unlist all but the ``keep`` highest steps (and the new one, and those in use) into ``trash``."""
        try:
            complete = self.storage.list(job_id)
        except OSError as exc:
            warnings.append(f"retention could not list {self.storage.location(job_id)}: {exc}")
            return
        keep_steps = {step for step, _ in complete[-keep:]} | {new_step} | self.in_use(job_id)
        for step, where in complete:
            if step not in keep_steps:
                try:
                    trash.append(self.storage.unlist(where))
                except OSError as exc:
                    warnings.append(f"retention could not remove {where}: {exc}")
