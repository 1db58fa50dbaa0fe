"""Restore by assembly: a rank's segment built from any ranks' files, locally or from the store.

The plain restore (:mod:`.restore`) copies one local rank file into the same rank's segment.
This one serves what that cannot: a rank whose file is not on this host (read from the store),
and a job restarted at another world size (each new rank's shards cut from the old ranks'
shards, :mod:`.reshard`). Call order::

    source = LocalSource(store, info)  |  StoreSource(stored, info)
    result = assemble(source, view, layout, rank=..., world_size=..., placement=..., reserve_staging=...)
    # its targets: restore_targets (the placement the trainer sent, or the rank's own manifest)

What it reads is verified before a byte of the segment changes: each old rank's manifest
against the snapshot's index, each data file's size and header against its manifest, and every
source tensor it reads against its crc32. Only the tensors a new rank needs are read (whole
tensors: their checksums cover them whole). The target bytes are staged in anonymous memory
(accounted by ``reserve_staging``, like the plain restore) and copied into the segment once
all of them verified; when the budget cannot hold them, the sources are verified in a first
pass and read again into the segment, each tensor checked again (a change in between fails
the restore: "restore again").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import ContextManager, Protocol

from swap_state.common.checksum import crc32
from swap_state.common.segment import SegmentLayout
from swap_state.common.snapshot_errors import SnapshotCorrupt, SnapshotError, SnapshotLayoutMismatch
from swap_state.common.snapshot_format import INDEX_NAME, RankManifest, TensorRecord
from swap_state.common.snapshot_metadata import BOOKKEEPING_PREFIX, SnapshotMetadata
from swap_state.common.snapshot_reader import SnapshotInfo, check_manifest_sizes
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.logs import log_event
from swap_state.server.snapshot.reshard import LayoutIndex, Piece, TargetTensor, ranks_needed
from swap_state.server.snapshot.store import SnapshotStore

__all__ = ["AssembleSource", "LocalSource", "StoreSource", "restore_targets", "assemble", "Assembled"]

log = logging.getLogger("swap_state.server.restore")


class AssembleSource(Protocol):
    """Where a snapshot's rank files are read from, verified."""

    info: SnapshotInfo
    where: str
    """``local`` or ``store``: what the restore reply and logs say."""

    def read_manifest(self, rank: int) -> RankManifest: ...

    def check_data_header(self, manifest: RankManifest) -> None: ...

    def read_tensor(self, manifest: RankManifest, tensor: TensorRecord) -> bytes: ...


class LocalSource:
    """A snapshot in this server's ``--snapshot-dir`` that holds every rank it is asked for."""

    where = "local"

    def __init__(self, store: SnapshotStore, info: SnapshotInfo):
        self.store, self.info = store, info

    def read_manifest(self, rank: int) -> RankManifest:
        return self.store.read_manifest(self.info, rank)

    def check_data_header(self, manifest: RankManifest) -> None:
        header, expected = check_manifest_sizes(self.info, manifest)
        path = self.info.path / manifest.data_file
        try:
            with open(path, "rb", buffering=0) as file:
                size = os.fstat(file.fileno()).st_size
                if size != expected:
                    raise SnapshotCorrupt(f"{path} is {size} bytes; its manifest implies {expected}")
                if os.pread(file.fileno(), len(header), 0) != header:
                    raise SnapshotCorrupt(f"{path}: safetensors header does not match its manifest")
        except FileNotFoundError:
            raise SnapshotCorrupt(f"{path} is missing") from None
        except OSError as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None

    def read_tensor(self, manifest: RankManifest, tensor: TensorRecord) -> bytes:
        path = self.info.path / manifest.data_file
        data = self.store.storage.read_range(self.info.path, manifest.data_file,
                                             manifest.data_start + tensor.data_offsets[0], tensor.nbytes)
        if len(data) != tensor.nbytes or crc32(data) != tensor.crc32:
            raise SnapshotCorrupt(f"{path}: tensor {tensor.name!r} fails its checksum")
        return data


class StoreSource:
    """A snapshot complete in the store (``--snapshot-store``)."""

    where = "store"

    def __init__(self, stored: StoredSnapshots, info: SnapshotInfo):
        self.stored, self.info = stored, info

    def read_manifest(self, rank: int) -> RankManifest:
        return self.stored.read_manifest(self.info, rank)

    def check_data_header(self, manifest: RankManifest) -> None:
        self.stored.check_data_header(self.info, manifest)

    def read_tensor(self, manifest: RankManifest, tensor: TensorRecord) -> bytes:
        return self.stored.read_tensor(self.info, manifest, tensor)


class Assembled:
    """What :func:`assemble` loaded."""

    def __init__(self, bytes_restored: int, source_ranks: list[int], metadata_json: str, staged: bool):
        self.bytes_restored = bytes_restored
        self.source_ranks = source_ranks
        self.metadata_json = metadata_json
        self.staged = staged


def restore_targets(layout: SegmentLayout, placement: SnapshotMetadata | None, own: RankManifest | None,
                    world_size: int, info: SnapshotInfo) -> list[TargetTensor]:
    """The restoring rank's tensors with their DTensor placement: from the trainer's
    ``placement`` (RestoreRequest.metadata_json) when it sent one, else, at the snapshot's own
    world size, from the rank's own manifest; a reshard without it is refused."""
    if placement is not None and placement.tensors:
        described = placement.tensors
    elif own is not None and info.world_size == world_size:
        described = {t.name: t for t in own.tensors}
    else:
        raise SnapshotLayoutMismatch(
            f"{info.path / INDEX_NAME}: {info.snapshot_id} was taken with world_size {info.world_size}, this job has "
            f"{world_size}, and the trainer sent no placement of its tensors to reshard it "
            "(RestoreRequest.metadata_json): upgrade the swap-state client"
        )
    targets = []
    for tensor in layout.tensors:
        meta = described.get(tensor.name)
        targets.append(TargetTensor(tensor.name, tensor.dtype, tuple(tensor.shape),
                                    getattr(meta, "global_shape", None), getattr(meta, "global_offset", None)))
    return targets


def assemble(
    source: AssembleSource,
    view: memoryview,
    layout: SegmentLayout,
    *,
    rank: int,
    world_size: int,
    placement: SnapshotMetadata | None,
    reserve_staging: Callable[[int], ContextManager[bool]] | None = None,
) -> Assembled:
    """Plan, read and verify every piece of ``rank``'s tensors, then copy them into ``view``.
    Each old rank's manifest is read once for all the ranks of this server that restore the
    snapshot together (:data:`RECENT`); the targets' placement may come from this rank's."""
    info = source.info
    read = RECENT.read(source)
    manifests = read.manifests
    same_world = info.world_size == world_size
    own = manifests.get(rank) if same_world else None
    targets = restore_targets(layout, placement, own, world_size, info)
    if not same_world:  # the trainer rebuilds its bookkeeping from the restored metadata
        targets = [t for t in targets if not t.name.startswith(BOOKKEEPING_PREFIX)]
    targets, index = _full_tensors_as_boxes(targets, read.index)
    plan = index.plan(targets, target_rank=rank, same_world=same_world)
    needed = ranks_needed(plan)
    for r in needed:
        source.check_data_header(manifests[r])
    by_name = {t.name: t for t in layout.tensors}
    nbytes = sum(by_name[name].nbytes for name in plan)
    reserve = reserve_staging(nbytes) if reserve_staging is not None else contextlib.nullcontext(True)
    with reserve as granted:
        if granted:
            _staged_copy(source, manifests, plan, view, by_name, nbytes)
        else:
            log_event(log, "restore_unstaged", logging.WARNING, snapshot_id=info.snapshot_id, rank=rank,
                      staged_bytes_needed=nbytes, detail="verifying the sources, then reading them again")
            _fill(source, manifests, plan, None, {})  # verify everything first
            _fill(source, manifests, plan, view, {n: by_name[n].offset for n in plan}, again=True)
    base = rank if same_world and rank in manifests else min(needed or list(manifests))
    others = [manifests[r].metadata_json for r in needed if r != base]
    return Assembled(nbytes, needed, _restored_metadata(manifests[base].metadata_json, others, placement), granted)


def _full_tensors_as_boxes(targets: list[TargetTensor], index: LayoutIndex) -> tuple[list[TargetTensor], LayoutIndex]:
    """A plain tensor and a DTensor of the same global shape are the same tensor, whole: a job
    sharded (FSDP) at one world size is not at another (torchtitan applies no FSDP on one rank).
    A plain target whose sources are DTensors of its shape becomes the box of the whole
    tensor; plain sources of a DTensor target's global shape become whole boxes, only when
    every rank holds the same bytes (crc32): replicas, never one rank's guess."""
    promoted: dict[str, list[tuple[int, TensorRecord]]] = {}
    out = []
    for target in targets:
        sources = index.records(target.name)
        if target.global_shape is None and sources and all(
            r.global_shape is not None and tuple(r.global_shape) == target.shape for _, r in sources
        ):
            target = dataclasses.replace(target, global_shape=target.shape, global_offset=(0,) * len(target.shape))
        elif target.global_shape is not None and sources and len({r.crc32 for _, r in sources}) == 1 and all(
            r.global_shape is None and tuple(r.shape) == tuple(target.global_shape) for _, r in sources
        ):
            promoted[target.name] = [
                (rank, dataclasses.replace(r, global_shape=r.shape, global_offset=(0,) * len(r.shape)))
                for rank, r in sources
            ]
        out.append(target)
    return out, (index.replaced(promoted) if promoted else index)


class ReadSnapshot:
    """A snapshot's manifests, each verified against its index, and their layout index."""

    def __init__(self, manifests: dict[int, RankManifest]):
        self.manifests = manifests
        self.index = LayoutIndex({rank: manifest.tensors for rank, manifest in manifests.items()})


class RecentSnapshots:
    """The snapshots assembled from lately, read once for the ranks of this server that restore
    them together: 8 ranks restoring a snapshot of N ranks read and index the N manifests once,
    not 8 times, and hold one copy of them. An entry lives while a restore uses it and
    ``keep_s`` after its last read (the ranks of a host call Restore about together), never
    longer: at 1,024 old ranks the manifests are about a GiB."""

    def __init__(self, keep_s: float = 30.0):
        self._keep_s = keep_s
        self._lock = threading.Lock()
        self._live: weakref.WeakValueDictionary[tuple, ReadSnapshot] = weakref.WeakValueDictionary()
        self._loading: dict[tuple, threading.Lock] = {}  # per snapshot: held while one rank reads it
        self._kept: ReadSnapshot | None = None
        self._kept_count = 0  # which keep a release timer ends (the timer holds no reference)
        self._release: threading.Timer | None = None

    def read(self, source: AssembleSource) -> ReadSnapshot:
        info = source.info
        # A snapshot replaced under the same id (a step trained again) has another index: its
        # files' checksums, its attempt and time.
        key = (source.where, str(info.path), info.index)
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        # The first rank reads while the others of this snapshot wait for it and share the
        # result; restores of other snapshots do not wait (a store's N reads take a while).
        with loading:
            try:
                with self._lock:
                    read = self._live.get(key)
                if read is None:
                    read = ReadSnapshot({r: source.read_manifest(r) for r in info.ranks})
                with self._lock:
                    self._live[key] = read
                    self._keep(read)
                return read
            finally:
                with self._lock:  # read or failed: a later caller finds it live, or reads anew
                    self._loading.pop(key, None)

    def _keep(self, read: ReadSnapshot) -> None:
        if self._release is not None:
            self._release.cancel()
        self._kept = read
        self._kept_count += 1
        self._release = threading.Timer(self._keep_s, self._drop, args=(self._kept_count,))
        self._release.daemon = True
        self._release.start()

    def _drop(self, count: int) -> None:
        with self._lock:
            if self._kept_count == count:
                self._kept = None


#: The server's one :class:`RecentSnapshots` (restores run in its executor threads).
RECENT = RecentSnapshots()


def _staged_copy(source: AssembleSource, manifests: Mapping[int, RankManifest], plan: Mapping[str, list[Piece]],
                 view: memoryview, by_name, nbytes: int) -> None:
    """Every piece into anonymous staging memory laid out like the segment's tensors, then
    (all verified) into the segment."""
    offsets, position = {}, 0
    for name in plan:
        offsets[name] = position
        position += by_name[name].nbytes
    staging = mmap.mmap(-1, max(1, nbytes))
    try:
        with memoryview(staging) as staged:
            _fill(source, manifests, plan, staged, offsets)
            for name in plan:  # verified: only now the segment changes
                target = by_name[name]
                view[target.offset : target.offset + target.nbytes] = staged[offsets[name] : offsets[name] + target.nbytes]
    finally:
        staging.close()


def _fill(source: AssembleSource, manifests: Mapping[int, RankManifest], plan: Mapping[str, list[Piece]],
          dest: memoryview | None, offsets: Mapping[str, int], again: bool = False) -> None:
    """Read (verified) the source tensor of every piece and copy its runs to ``dest`` where
    the target's bytes start (``offsets``; ``dest`` None: verify only)."""
    for name, pieces in plan.items():
        for piece in pieces:
            try:
                data = source.read_tensor(manifests[piece.source_rank], piece.source)
            except SnapshotCorrupt as exc:
                if again:
                    raise SnapshotCorrupt(f"{exc}; it changed while being restored and the segment is "
                                          "partially overwritten: restore again") from None
                raise
            if dest is None:
                continue
            base = offsets[name]
            with memoryview(data) as src:
                for run in piece.runs:
                    start = base + run.target_offset
                    dest[start : start + run.nbytes] = src[run.source_offset : run.source_offset + run.nbytes]


def _restored_metadata(saved: str, others: Sequence[str], placement: SnapshotMetadata | None) -> str:
    """The snapshot's metadata as Restore returns it: the old rank's (``saved``), with the
    per-parameter entries (param groups, steps, model aliases) of the other old ranks read
    (``others``: a pipeline stage holds only its own parameters' entries) where ``saved`` lacks
    them, and the tensors' entries the restoring rank's own (after a reshard the old rank's
    offsets are not this rank's)."""
    if not saved.strip() or (not others and (placement is None or not placement.tensors)):
        return saved
    raw = json.loads(saved)
    for other in others:
        for key, entries in (json.loads(other) if other.strip() else {}).items():
            if key != "tensors" and isinstance(entries, dict):
                raw[key] = {**entries, **raw.get(key, {})}
    if placement is not None and placement.tensors:
        raw["tensors"] = json.loads(placement.raw).get("tensors", {})
    return json.dumps(raw, allow_nan=False)