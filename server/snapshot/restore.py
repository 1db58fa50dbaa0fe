"""Restore: a durable snapshot into a session's segment, verified first.

Call order (the servicer, for Restore): ``restore(coordinator.directory, snapshot_id,
segment_mmap, layout, job_id=..., rank=..., world_size=..., reserve_staging=..., stored=...,
placement_json=...)`` returns the snapshot's step and the trainer's metadata once the tensors
are written. It picks the tier (:func:`~.tiers.resolve_source`) and checks the segment;
:mod:`.assemble` plans, reads and verifies. Any mismatch raises (SnapshotNotFound,
SnapshotLayoutMismatch, SnapshotCorrupt, naming the file and tensor) before the segment changes.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import ContextManager

from swap_state.common.segment import SegmentHeader, SegmentLayout, Word
from swap_state.common.snapshot_errors import SnapshotBusy, SnapshotError
from swap_state.common.snapshot_metadata import parse_metadata
from swap_state.common.snapshot_reader import SnapshotInfo
from swap_state.common.stored_snapshots import StoredSnapshots

from swap_state.server.logs import log_event
from swap_state.server.snapshot.assemble import RestoreResult, assemble, check_layout, check_world_size
from swap_state.server.snapshot.tiers import resolve_source
from swap_state.server.snapshot.directory import SnapshotDirectory

__all__ = ["RestoreResult", "check_layout", "restore"]

log = logging.getLogger("swap_state.server.restore")


def restore(directory: SnapshotDirectory, snapshot_id: str, buffer, layout: SegmentLayout, *, rank: int,
            world_size: int, job_id: str | None = None, header: SegmentHeader | None = None,
            reserve_staging: Callable[[int], ContextManager[bool]] | None = None,
            staging_free_bytes: Callable[[], int] | None = None, stored: StoredSnapshots | None = None,
            placement_json: str = "",
            may_read: Callable[[SnapshotInfo], None] | None = None) -> RestoreResult:
    """Verify ``snapshot_id`` (``<job>/step-<N>``, or ``latest`` of ``job_id``) for ``rank`` against
    ``layout``, then copy it into ``buffer`` (the writable mapped segment, not under a snapshot).

    ``world_size``: the job's global one. ``reserve_staging(nbytes)``: yields whether the budget
    holds the staged bytes (None: always). ``stored``: the store, for snapshots this server
    does not hold. ``placement_json``: the rank's DTensor placement, needed to reshard.
    ``may_read(info)`` raises (PermissionDenied) before anything is read. On any error
    (SnapshotNotFound, SnapshotLayoutMismatch, SnapshotCorrupt, SnapshotBusy) the segment is untouched.
    """
    own_header = header is None
    if header is None:
        header = SegmentHeader(buffer, layout.n_chunks, layout.cow_slots)
    view = memoryview(buffer)
    try:
        if view.nbytes < layout.size:
            raise SnapshotError(f"segment buffer is smaller than its layout ({layout.size} bytes)")
        if header[Word.SNAP_EPOCH] != 0:
            raise SnapshotBusy("a snapshot of this segment is persisting; restore after it ends")
        tier, info = resolve_source(directory, stored, snapshot_id, job_id, rank, world_size)
        if may_read is not None:
            may_read(info)
        if tier.where == "local" and not info.index.complete_job:
            check_world_size(info, world_size)  # a host's own part of a multi-host snapshot: not resharded
        placement = parse_metadata(placement_json, layout.tensors, sys.maxsize) if placement_json else None
        done = assemble(tier, info, view, layout, rank=rank, world_size=world_size, placement=placement,
                        reserve_staging=reserve_staging, staging_free_bytes=staging_free_bytes)
        log_event(log, "restore_assembled", snapshot_id=info.snapshot_id, rank=rank, world_size=world_size,
                  snapshot_world_size=info.world_size, source=tier.where,
                  source_ranks=list(done.source_ranks), bytes=done.bytes_restored, staged=done.staged,
                  plan=done.plan, location=str(info.path))
        return done
    finally:
        view.release()
        if own_header:
            header.release()
