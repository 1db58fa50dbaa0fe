"""Restore: copy a durable snapshot's rank file into a session's segment, verified first.

Call order (the servicer, for Restore): resolve the session's segment, then
``restore(coordinator.store, snapshot_id, segment_mmap, layout, job_id=..., rank=...,
world_size=...)``; on success it has written the tensors and returns the snapshot's step and
the trainer's ``metadata_json`` (the servicer then records the restored step as committed).

Everything is checked before the first byte of the segment changes: the snapshot is complete,
its (global) world size matches the job's, it holds this rank (on a multi-host job each
server's snapshot holds the ranks attached to it: a rank missing here is SnapshotNotFound,
naming the ranks present and pointing at the other hosts' servers), this rank's tensors
(names, dtypes, shapes, order) match the target layout, the manifest matches
``snapshot.json`` and every tensor's crc32 matches. Any mismatch raises
(SnapshotLayoutMismatch, SnapshotCorrupt, naming the file and the tensor) and leaves the
segment untouched.
"""

from __future__ import annotations

import dataclasses
import os

from swap_state.common.segment import SegmentHeader, SegmentLayout, Word

from swap_state.common.snapshot_errors import SnapshotBusy, SnapshotCorrupt, SnapshotError, SnapshotLayoutMismatch
from swap_state.common.snapshot_format import INDEX_NAME, RankManifest
from .snapshot_store import SnapshotInfo, SnapshotStore

__all__ = ["RestoreResult", "check_layout", "restore"]


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a successful restore loaded."""

    snapshot_id: str
    """The resolved id (``latest`` becomes ``<job>/step-<N>``)."""
    step: int
    """The step the segment now holds."""
    metadata_json: str
    """The trainer's metadata of that snapshot, verbatim."""
    bytes_restored: int
    """Tensor bytes copied into the segment."""


def _describe(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}{list(shape)}"


def _check_world_size(info: SnapshotInfo, world_size: int) -> None:
    if info.world_size != world_size:
        held = "" if info.index.complete_job else f" (this server holds its {info.describe_ranks()})"
        raise SnapshotLayoutMismatch(
            f"{info.path / INDEX_NAME}: {info.snapshot_id} was taken with world_size "
            f"{info.world_size}, this job has {world_size}{held}"
        )


def check_layout(info: SnapshotInfo, manifest: RankManifest, layout: SegmentLayout, world_size: int) -> None:
    """SnapshotLayoutMismatch unless the snapshot fits a segment of ``layout`` in a job of
    ``world_size`` ranks, naming the file and the first differing tensor."""
    _check_world_size(info, world_size)
    path = info.path / manifest.data_file
    ours = {t.name: t for t in layout.tensors}
    theirs = {t.name for t in manifest.tensors}
    for tensor in manifest.tensors:
        if tensor.name not in ours:
            raise SnapshotLayoutMismatch(f"{path}: tensor {tensor.name!r} is not in the segment")
    for target in layout.tensors:
        if target.name not in theirs:
            raise SnapshotLayoutMismatch(f"{path}: has no tensor {target.name!r} the segment holds")
    for position, (tensor, target) in enumerate(zip(manifest.tensors, layout.tensors)):
        if (tensor.dtype, tensor.shape) != (ours[tensor.name].dtype, ours[tensor.name].shape):
            raise SnapshotLayoutMismatch(
                f"{path}: tensor {tensor.name!r} is {_describe(tensor.dtype, tensor.shape)}, "
                f"the segment's is {_describe(ours[tensor.name].dtype, ours[tensor.name].shape)}"
            )
        if tensor.name != target.name:
            raise SnapshotLayoutMismatch(
                f"{path}: tensor {tensor.name!r} is at position {position}, the segment has "
                f"{target.name!r} there (the update order differs)"
            )


def _copy_into(path: os.PathLike[str], manifest: RankManifest, view: memoryview, layout: SegmentLayout) -> int:
    """Read each tensor straight into its place in the segment."""
    copied = 0
    with open(path, "rb", buffering=0) as file:
        for tensor, target in zip(manifest.tensors, layout.tensors):
            file.seek(manifest.data_start + tensor.data_offsets[0])
            dest = view[target.offset : target.offset + target.nbytes]
            done = 0
            while done < target.nbytes:
                got = file.readinto(dest[done:])
                if not got:
                    raise SnapshotCorrupt(
                        f"{path} shrank while being restored (tensor {tensor.name!r}); the "
                        "segment is partially overwritten: restore again"
                    )
                done += got
            copied += done
    return copied


def restore(
    store: SnapshotStore,
    snapshot_id: str,
    buffer,
    layout: SegmentLayout,
    *,
    rank: int,
    world_size: int,
    job_id: str | None = None,
    header: SegmentHeader | None = None,
) -> RestoreResult:
    """Verify ``snapshot_id`` (``<job>/step-<N>``, or ``latest`` of ``job_id``) for ``rank``
    against ``layout``, then copy it into ``buffer`` (the writable mapped segment).

    ``header``: the segment's SegmentHeader if the caller has one (else made here); the
    segment must not be under a snapshot (SnapshotBusy). ``world_size`` is the job's global
    one; ``rank`` must be among the snapshot's ranks. Raises SnapshotNotFound,
    SnapshotLayoutMismatch, SnapshotCorrupt, SnapshotBusy; the segment is untouched then.
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
        info = store.resolve(snapshot_id, job_id)
        _check_world_size(info, world_size)  # before the manifest: rank may not exist there
        manifest = store.read_manifest(info, rank)  # SnapshotNotFound: the rank is elsewhere
        check_layout(info, manifest, layout, world_size)
        store.verify_data(info, manifest)
        # Verified: only now the segment changes.
        copied = _copy_into(info.path / manifest.data_file, manifest, view, layout)
        return RestoreResult(info.snapshot_id, info.step, manifest.metadata_json, copied)
    finally:
        view.release()
        if own_header:
            header.release()
