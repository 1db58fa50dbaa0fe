"""Restore: a durable snapshot's rank file into a session's segment, read once, verified first.

Call order (the servicer, for Restore): resolve the session's segment, then
``restore(coordinator.store, snapshot_id, segment_mmap, layout, job_id=..., rank=...,
world_size=..., reserve_staging=arena.reserve_staging)``; on success it has written the
tensors and returns the snapshot's step and the trainer's ``metadata_json`` (the servicer then
records the restored step as committed).

Everything is checked before the first byte of the segment changes: the snapshot is complete,
its (global) world size matches the job's, it holds this rank (on a multi-host job each
server's snapshot holds the ranks attached to it: a rank missing here is SnapshotNotFound,
naming the ranks present and pointing at the other hosts' servers), this rank's tensors
(names, dtypes, shapes, order) match the target layout, the manifest matches
``snapshot.json`` and every tensor's crc32 matches. Any mismatch raises
(SnapshotLayoutMismatch, SnapshotCorrupt, naming the file and the tensor) and leaves the
segment untouched.

Read once (*staged*, :mod:`.staged_read`): a reader thread reads the data file region by
region (mapped, read ahead and pinned with ``mlock``) while this thread checksums the regions already read. Only when
every checksum has passed are the staged bytes copied (``memmove``, GIL released) into the
segment, and the staging released. The staged bytes are
accounted: ``reserve_staging(nbytes)`` (the arena's) holds them out of the budget's free bytes
for the duration. When the budget cannot hold them, restore falls back to verifying the whole
file and then reading it again into the segment (logged as ``restore_unstaged``, with the
numbers). Where the file is mapped and ``mlock`` is refused (RLIMIT_MEMLOCK), the bytes stay
staged in the page cache unpinned and every copied chunk is checksummed again as it lands: a
file that changed underneath fails the restore (SnapshotCorrupt, "restore again") instead of
going unnoticed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import ContextManager

from swap_state.common.checksum import crc32
from swap_state.common.segment import SegmentHeader, SegmentLayout, Word
from swap_state.common.snapshot_errors import (
    SnapshotBusy,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotLayoutMismatch,
)
from swap_state.common.snapshot_metadata import parse_metadata
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.common.snapshot_format import INDEX_NAME, RankManifest
from swap_state.common.snapshot_reader import RankFileVerifier

from swap_state.server import _posix
from swap_state.server.logs import log_event
from swap_state.server.snapshot import staged_read
from swap_state.server.snapshot.staged_read import Staging, stage_file
from swap_state.server.snapshot.assemble import LocalSource, StoreSource, assemble
from swap_state.server.snapshot.tiers import resolve_source
from swap_state.server.snapshot.store import SnapshotInfo, SnapshotStore

__all__ = ["RestoreResult", "check_layout", "restore"]

log = logging.getLogger("swap_state.server.restore")

_COPY_BYTES = 8 << 20
"""Unit of the copy into the segment (and of its re-check when the pages are not pinned)."""


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a successful restore loaded."""

    snapshot_id: str
    """The resolved id (``latest`` becomes ``<job>/step-<N>``)."""
    step: int
    """The step the segment now holds."""
    metadata_json: str
    """The trainer's metadata of that snapshot (every fact it gave; rebuilt by the manifest)."""
    bytes_restored: int
    """Tensor bytes copied into the segment."""
    staged: bool = True
    """Read once and staged (else verified, then read again: the budget could not hold it)."""
    pinned: bool = True
    """The staged bytes could not change before the copy (read with O_DIRECT into private
    memory, or mapped and pinned with mlock); else each copied chunk was checked again."""
    source: str = "local"
    """Where the files were read: ``local`` (--snapshot-dir) or ``store`` (--snapshot-store)."""
    snapshot_world_size: int = 0
    """The world size the snapshot was taken at (resharded when not the job's)."""
    source_ranks: tuple[int, ...] = ()
    """The snapshot's ranks whose files were read."""


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


def _copy_staged(staged: Staging, manifest: RankManifest, view: memoryview, layout: SegmentLayout,
                 path: os.PathLike[str]) -> int:
    """Every (verified) tensor from the staged mapping into its place in the segment; the
    copies re-checked when the pages were not pinned."""
    base = _posix.buffer_address(view)
    copied = 0
    for tensor, target in zip(manifest.tensors, layout.tensors):
        source = manifest.data_start + tensor.data_offsets[0]
        value = 0
        for done in range(0, target.nbytes, _COPY_BYTES):
            n = min(_COPY_BYTES, target.nbytes - done)
            _posix.memmove(base + target.offset + done, staged.address + source + done, n)
            if not staged.pinned:
                with view[target.offset + done : target.offset + done + n] as landed:
                    value = crc32(landed, value)
        if not staged.pinned and value != tensor.crc32:
            raise SnapshotCorrupt(
                f"{path} changed while being restored (tensor {tensor.name!r} no longer matches "
                "its checksum); the segment is partially overwritten: restore again"
            )
        copied += target.nbytes
    return copied


def _restore_staged(info: SnapshotInfo, manifest: RankManifest, view: memoryview,
                    layout: SegmentLayout) -> tuple[int, bool]:
    """Read the rank's data file once, verify it all, then copy it: (bytes, pinned)."""
    verifier = RankFileVerifier(info, manifest)  # the reader's checks, fed from the staged pages
    path = verifier.path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotCorrupt(f"{path} is missing") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from None
    try:
        size = os.fstat(fd).st_size
        verifier.check_size(size)
        try:
            staged = stage_file(fd, size)
        except OSError as exc:
            raise SnapshotError(f"cannot map {path}: {exc}") from None
        try:
            header_end = len(verifier.header)
            staged.wait(header_end)
            verifier.check_header(staged.view[:header_end])
            position = header_end
            while position < size:  # checksum each region as soon as it is in memory
                upto = min(size, (position // staged_read.STAGE_REGION_BYTES + 1) * staged_read.STAGE_REGION_BYTES)
                staged.wait(upto)
                verifier.feed(staged.view[position:upto])
                position = upto
            verifier.finish()
            if not staged.pinned:
                log_event(log, "restore_unpinned", logging.WARNING, path=path, bytes=size,
                          errno=staged.pin_errno,
                          detail="mlock refused (RLIMIT_MEMLOCK?): the staged pages may be evicted; "
                          "every copied chunk is checked again")
            # Verified: only now the segment changes.
            return _copy_staged(staged, manifest, view, layout, path), staged.pinned
        finally:
            staged.close()
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from None
    finally:
        os.close(fd)


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
    reserve_staging: Callable[[int], ContextManager[bool]] | None = None,
    staging_free_bytes: Callable[[], int] | None = None,
    stored: StoredSnapshots | None = None,
    placement_json: str = "",
) -> RestoreResult:
    """Verify ``snapshot_id`` (``<job>/step-<N>``, or ``latest`` of ``job_id``) for ``rank``
    against ``layout``, then copy it into ``buffer`` (the writable mapped segment).

    ``header``: the segment's SegmentHeader if the caller has one (else made here); the
    segment must not be under a snapshot (SnapshotBusy). ``world_size`` is the job's global
    one. ``reserve_staging(nbytes)``: a context manager yielding whether the budget holds the
    staged bytes (the arena's; None: always); ``staging_free_bytes()``: the free budget, for
    the log line when it does not. ``stored``: the store (``--snapshot-store``), where a
    snapshot this server does not hold (another host's rank, a lost host's) is read from;
    ``placement_json``: the rank's tensors' DTensor placement (RestoreRequest.metadata_json),
    needed to reshard a snapshot taken at another world size.

    Which way (:func:`resolve_source`): the rank's own local file at the same world size is
    copied whole (this module); anything else is assembled (:mod:`.assemble`).
    Raises SnapshotNotFound, SnapshotLayoutMismatch, SnapshotCorrupt, SnapshotBusy; the
    segment is untouched then.
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
        info, in_store = resolve_source(store, stored, snapshot_id, job_id, rank, world_size)
        if not in_store and (info.world_size != world_size or rank not in info.ranks) and not info.index.complete_job:
            _check_world_size(info, world_size)  # the errors of a host's own snapshot, as before
        if in_store or info.world_size != world_size:
            source = StoreSource(stored, info) if in_store else LocalSource(store, info)
            return _assembled(source, view, layout, rank, world_size, placement_json, reserve_staging)
        return _restore_own(store, info, view, layout, rank, world_size, reserve_staging, staging_free_bytes)
    finally:
        view.release()
        if own_header:
            header.release()


def _restore_own(store: SnapshotStore, info: SnapshotInfo, view: memoryview, layout: SegmentLayout, rank: int,
                 world_size: int, reserve_staging, staging_free_bytes) -> RestoreResult:
    """The rank's own local file, copied whole (staged, or verified then read again)."""
    manifest = store.read_manifest(info, rank)  # SnapshotNotFound: the rank is elsewhere
    check_layout(info, manifest, layout, world_size)
    nbytes = sum(t.nbytes for t in manifest.tensors)
    reserve = reserve_staging(nbytes) if reserve_staging is not None else contextlib.nullcontext(True)
    with reserve as granted:
        if granted:
            copied, pinned = _restore_staged(info, manifest, view, layout)
            return RestoreResult(info.snapshot_id, info.step, manifest.metadata_json, copied,
                                 staged=True, pinned=pinned, snapshot_world_size=info.world_size,
                                 source_ranks=(rank,))
    log_event(log, "restore_unstaged", logging.WARNING, snapshot_id=info.snapshot_id,
              rank=rank, staged_bytes_needed=nbytes,
              budget_free_bytes=staging_free_bytes() if staging_free_bytes else None,
              detail="the budget's free bytes cannot hold the staged state: verifying the "
              "whole file, then reading it again into the segment")
    store.verify_data(info, manifest)
    # Verified: only now the segment changes.
    copied = _copy_into(info.path / manifest.data_file, manifest, view, layout)
    return RestoreResult(info.snapshot_id, info.step, manifest.metadata_json, copied,
                         staged=False, pinned=False, snapshot_world_size=info.world_size, source_ranks=(rank,))


def _assembled(source, view: memoryview, layout: SegmentLayout, rank: int, world_size: int,
               placement_json: str, reserve_staging) -> RestoreResult:
    """Assembled from the store, or resharded (:mod:`.assemble`), logged as such."""
    info = source.info
    placement = parse_metadata(placement_json, layout.tensors, sys.maxsize) if placement_json else None
    done = assemble(source, view, layout, rank=rank, world_size=world_size, placement=placement,
                    reserve_staging=reserve_staging)
    log_event(log, "restore_assembled", snapshot_id=info.snapshot_id, rank=rank, world_size=world_size,
              snapshot_world_size=info.world_size, source=source.where, source_ranks=done.source_ranks,
              bytes=done.bytes_restored, location=str(info.path))
    return RestoreResult(info.snapshot_id, info.step, done.metadata_json, done.bytes_restored,
                         staged=done.staged, pinned=False, source=source.where,
                         snapshot_world_size=info.world_size, source_ranks=tuple(done.source_ranks))
