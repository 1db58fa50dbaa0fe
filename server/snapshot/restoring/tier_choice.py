"""Which tier a snapshot is read from, for Restore (:func:`resolve_source`) and ListSnapshots' ``latest``
(:func:`list_both_tiers`): the local ``--snapshot-dir`` when it holds the restoring rank at the job's world size, or
every rank of its job; otherwise the ``--snapshot-store``. With a store, ``latest`` is the newest step complete for the
whole job in either tier, so every rank of a job resolves it to the same step."""

from __future__ import annotations

import dataclasses
import logging

from swap_state.common.names import parse_snapshot_id, snapshot_id_for
from swap_state.common.object_store import STORE_FLAG
from swap_state.common.snapshot_errors import SnapshotInvalid, SnapshotNotFoundError, StoreUnavailableError
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.logs import log_event

__all__ = ["list_both_tiers", "resolve_source"]

log = logging.getLogger(__name__)


def resolve_source(directory: SnapshotTier, stored: StoredSnapshots | None, snapshot_id: str, job_id: str | None,
                   rank: int, world_size: int) -> tuple[SnapshotTier, SnapshotInfo]:
    """The snapshot to restore and the tier it is read from (the module docstring's rule)."""
    if stored is None:
        return directory, directory.resolve(snapshot_id, job_id)
    try:
        local = directory.resolve(snapshot_id, job_id)
    except SnapshotNotFoundError:
        local = None
    try:
        remote = stored.resolve(snapshot_id, job_id)
    except SnapshotNotFoundError as exc:
        if local is None:
            raise SnapshotNotFoundError(f"{exc}; nor in this server's --snapshot-dir {directory.root}") from None
        return directory, local
    except StoreUnavailableError as exc:
        if local is not None and parse_snapshot_id(snapshot_id, job_id, SnapshotInvalid).latest:
            # The store may hold a newer step (another host's, a lost host's): never a silent rewind.
            raise StoreUnavailableError(
                f"{exc}: 'latest' cannot be resolved while the store is unreachable (it may hold a step "
                f"newer than this server's newest, {local.snapshot_id}); fix the store, or restore "
                f"{local.snapshot_id} by its id") from None
        if local is not None and (local.index.complete_job or rank in local.ranks):
            log_event(log, "store_unreachable", logging.WARNING, store=stored.uri, error=str(exc),
                      detail=f"restoring {local.snapshot_id} from the local --snapshot-dir")
            return directory, local
        raise StoreUnavailableError(
            f"{exc} (looking for {snapshot_id}); this server's --snapshot-dir {directory.root} has no "
            f"copy for rank {rank}"
        ) from None
    if local is None:
        return stored, remote
    whole = local.index.complete_job
    usable = whole or (local.world_size == world_size and rank in local.ranks)
    if parse_snapshot_id(snapshot_id, job_id, SnapshotInvalid).latest and local.step != remote.step:
        if whole and local.step > remote.step:
            return directory, local
        return _local_copy(directory, remote, rank, world_size) or (stored, remote)
    return (directory, local) if usable else (stored, remote)


def _local_copy(directory: SnapshotTier, remote: SnapshotInfo, rank: int,
                world_size: int) -> tuple[SnapshotTier, SnapshotInfo] | None:
    """This server's copy of the store's snapshot (same attempt, holding this rank), else None."""
    try:
        copy = directory.resolve(snapshot_id_for(remote.job_id, remote.step))
    except SnapshotNotFoundError:
        return None
    holds = copy.index.complete_job or (copy.world_size == world_size and rank in copy.ranks)
    return (directory, copy) if holds and copy.index.attempt == remote.index.attempt else None


def list_both_tiers(coordinator, job_id: str | None
                    ) -> tuple[list[tuple[SnapshotInfo | None, SnapshotInfo | None]], str]:
    """Every snapshot in either tier as (local, stored), by job then step, ``latest`` marking the
    step Restore's ``latest`` resolves to; and why the store could not be listed ("" when it was)."""
    local = {(i.job_id, i.step): i for i in coordinator.host.list(job_id)}
    stored, store_error = {}, ""
    if coordinator.stored is not None:
        try:
            stored = {(i.job_id, i.step): i for i in coordinator.stored.list(job_id)}
        except StoreUnavailableError as exc:  # the local tier is still worth listing
            store_error = f"{STORE_FLAG} {coordinator.stored.uri}: {exc}"
            log_event(log, "store_unreachable", logging.WARNING, store=coordinator.stored.uri, error=str(exc),
                      detail="listing the local snapshots only")
    if not stored:
        return [(info, None) for _, info in sorted(local.items())], store_error
    newest: dict[str, int] = {}
    for (job, step), info in [*local.items(), *stored.items()]:
        if info.index.complete_job:
            newest[job] = max(newest.get(job, step), step)
    keys = sorted(set(local) | set(stored))
    return [tuple(None if i is None else dataclasses.replace(i, latest=newest.get(key[0]) == key[1])
                  for i in (local.get(key), stored.get(key))) for key in keys], store_error  # type: ignore[misc]
