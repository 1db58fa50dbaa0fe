"""Restore: a durable snapshot into a session's segment, locally or from the store, at the snapshot's layout or
resharded to another (planned from the step's ``layout.json``, :mod:`.layout_index`). One path: pick the tier
(:mod:`.tier_choice`), plan, then read, verify and copy as it reads (:mod:`.restore_reads`), which keeps the restore at
the disk's pace; a failed check leaves the segment's state as it was (:func:`_read_pieces`)."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import mmap
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import ContextManager

from swap_state.common.text_enum import TextEnum
from swap_state.common.segment import SegmentHeader, SegmentLayout, Word
from swap_state.common.names import snapshot_id_for
from swap_state.common.snapshot_errors import (
    SnapshotBusyError, SnapshotCorruptError, SnapshotError, SnapshotLayoutMismatch, SnapshotNotFoundError)
from swap_state.common.snapshot_format import INDEX_NAME, LAYOUT_NAME, RankManifest
from swap_state.common.snapshot_metadata import BOOKKEEPING_PREFIX, SnapshotMetadata, parse_metadata
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server import _posix
from swap_state.server.logs import log_event
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, bind
from swap_state.server.snapshot.restoring.reshard import Piece, Run, TargetTensor, ranks_needed
from swap_state.server.snapshot.restoring.restore_reads import pieces_by_source, plan_reads, stream_tensors
from swap_state.server.snapshot.restoring.tier_choice import resolve_source
from swap_state.server.snapshot.tiers.replica_wire import WireError
from swap_state.server.snapshot.tiers.store import parts_layout

__all__ = ["RECENT", "Kept", "PlanSource", "RestoreResult", "assemble", "check_layout", "check_world_size", "restore"]

log = logging.getLogger(__name__)


class Kept(TextEnum):
    """What kept the segment's state safe while the snapshot was read."""

    NOTHING = "nothing"  # it held nothing to keep: a failure zeroes what was written
    SLOTS = "slots"  # its bytes copied aside into the segment's copy slots, put back on a failure
    MEMORY = "memory"  # the same, in memory the budget lent
    SLOTS_MEMORY = "slots+memory"  # what the slots could not hold, in memory
    VERIFY_FIRST = "verify-first"  # every checksum checked in a first read, then read again and copied


class PlanSource(TextEnum):
    """What a restore's plan came from."""

    OWN_FILE, LAYOUT_INDEX, EVERY_MANIFEST = "own-file", "layout-index", "every-manifest"


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a successful restore loaded."""

    snapshot_id: str  # the resolved id (``latest`` becomes ``<job>/step-<N>``)
    step: int
    metadata_json: str
    bytes_restored: int
    kept: Kept = Kept.NOTHING
    source: str = "local"  # where the files were read: ``local`` (--snapshot-dir) or ``store`` (--snapshot-store)
    snapshot_world_size: int = 0  # the world size the snapshot was taken at (resharded when not the job's)
    source_ranks: tuple[int, ...] = ()
    plan: PlanSource = PlanSource.OWN_FILE

    @property
    def staged(self) -> bool:
        """Read once (not verified first, then read again)."""
        return self.kept is not Kept.VERIFY_FIRST

    @property
    def streamed(self) -> bool:
        """Copied into the segment as it was read (the segment held nothing to keep)."""
        return self.kept is Kept.NOTHING


def check_world_size(info: SnapshotInfo, world_size: int) -> None:
    if info.world_size != world_size:
        held = "" if info.index.complete_job else f" (this server holds its {info.describe_ranks()})"
        raise SnapshotLayoutMismatch(f"{info.path / INDEX_NAME}: {info.snapshot_id} was taken with "
                                     f"world_size {info.world_size}, this job has {world_size}{held}")


def check_layout(info: SnapshotInfo, manifest: RankManifest, layout: SegmentLayout) -> None:
    """SnapshotLayoutMismatch, naming the file and first differing tensor, unless ``manifest`` fits ``layout``."""
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
        mine = ours[tensor.name]
        if (tensor.dtype, tensor.shape) != (mine.dtype, mine.shape):
            raise SnapshotLayoutMismatch(f"{path}: tensor {tensor.name!r} is {tensor.dtype}{list(tensor.shape)}, "
                                         f"the segment's is {mine.dtype}{list(mine.shape)}")
        if tensor.name != target.name:
            raise SnapshotLayoutMismatch(f"{path}: tensor {tensor.name!r} is at position {position}, the "
                                         f"segment has {target.name!r} there (the update order differs)")


def _same_layout(own: RankManifest, layout: SegmentLayout, placement: SnapshotMetadata | None) -> bool:
    """The rank's own file is its segment: the same tensors (names, dtypes, shapes, order) and,
    where the trainer sent their placement, the same boxes of the same global tensors."""
    pairs = zip(own.tensors, layout.tensors)
    if len(own.tensors) != len(layout.tensors) or any(
            (t.name, t.dtype, tuple(t.shape)) != (s.name, s.dtype, tuple(s.shape)) for t, s in pairs):
        return False
    described = placement.tensors if placement is not None else {}
    return all((meta := described.get(t.name)) is None
               or (meta.global_shape, meta.global_offset) == (t.global_shape, t.global_offset) for t in own.tensors)


def restore(directory: SnapshotTier, snapshot_id: str, buffer, layout: SegmentLayout, *, rank: int,
            world_size: int, header: SegmentHeader, job_id: str | None = None,
            reserve_staging: Callable[[int], ContextManager[bool]] | None = None,
            staging_free_bytes: Callable[[], int] | None = None, stored: StoredSnapshots | None = None,
            placement_json: str = "", may_read: Callable[[SnapshotInfo], None] | None = None) -> RestoreResult:
    """Verify ``snapshot_id`` (``<job>/step-<N>``, or ``latest`` of ``job_id``) for ``rank`` against ``layout``, then
    copy it into ``buffer`` (the writable mapped segment, not under a snapshot). ``reserve_staging(nbytes)`` yields
    whether the budget holds the staged bytes (None: always); ``placement_json`` is the rank's DTensor placement, needed
    to reshard; ``may_read(info)`` raises (PermissionDeniedError) before anything is read. On any error the segment is
    untouched, unless the trainer marked it being written (it held nothing to keep)."""
    started = time.monotonic()
    with memoryview(buffer) as view:
        if view.nbytes < layout.size:
            raise SnapshotError(f"segment buffer is smaller than its layout ({layout.size} bytes)")
        if header[Word.SNAP_EPOCH] != 0:
            raise SnapshotBusyError("a snapshot of this segment is persisting; restore after it ends")
        tier, info = resolve_source(directory, stored, snapshot_id, job_id, rank, world_size)
        if may_read is not None:
            may_read(info)
        if tier.where == "local" and not info.index.complete_job:
            check_world_size(info, world_size)  # a host's own part of a multi-host snapshot: not resharded
        placement = parse_metadata(placement_json, layout.tensors, sys.maxsize) if placement_json else None
        read = functools.partial(assemble, view=view, layout=layout, rank=rank, world_size=world_size,
                                 placement=placement, reserve_staging=reserve_staging,
                                 staging_free_bytes=staging_free_bytes, replaceable=header[Word.WRITING_STEP] != 0)
        try:
            done = read(tier, info)
        except (SnapshotCorruptError, SnapshotNotFoundError, WireError) as exc:
            tier, info = _store_copy(stored, tier, info, exc)  # the segment is as before (or zero): read again
            done = read(tier, info)
        log_event(log, "restore_assembled", snapshot_id=info.snapshot_id, rank=rank, world_size=world_size,
                  snapshot_world_size=info.world_size, source=tier.where, source_ranks=list(done.source_ranks),
                  bytes=done.bytes_restored, staged=done.staged, streamed=done.streamed, kept=done.kept, plan=done.plan,
                  location=str(info.path), read_from=tier.places(info, done.source_ranks),
                  seconds=round(time.monotonic() - started, 4))
        return done


def _store_copy(stored: StoredSnapshots | None, tier: SnapshotTier, info: SnapshotInfo,
                failure: SnapshotError) -> tuple[SnapshotTier, SnapshotInfo]:
    """After ``tier``'s copy of ``info`` failed (corrupt, gone, its peer lost): the store's copy of the same step and
    attempt, logged; else ``failure`` again. Never an older step: every rank of the job must restore the same one."""
    if stored is None or tier is stored:
        raise failure
    try:
        copy = stored.resolve(snapshot_id_for(info.job_id, info.step))
    except SnapshotError:
        copy = None
    if copy is None or copy.index.attempt != info.index.attempt:
        raise type(failure)(f"{failure}; the --snapshot-store holds no copy of {info.snapshot_id} to read "
                            "instead: restore an older step by its id") from None
    log_event(log, "restore_fallback", logging.WARNING, snapshot_id=info.snapshot_id, failed=tier.where,
              error=str(failure), detail="reading the --snapshot-store's copy of the same step instead")
    return stored, copy


def assemble(tier: SnapshotTier, info: SnapshotInfo, view: memoryview, layout: SegmentLayout, *, rank: int,
             world_size: int, placement: SnapshotMetadata | None,
             reserve_staging: Callable[[int], ContextManager[bool]] | None = None,
             staging_free_bytes: Callable[[], int] | None = None, replaceable: bool = False) -> RestoreResult:
    """Plan, read and verify every piece of ``rank``'s tensors, then copy them into ``view``.
    ``staging_free_bytes()``: the free budget, for the log line when it cannot hold them.
    ``replaceable``: the segment holds nothing to keep (copied as verified; a failure zeroes it)."""
    if info.world_size == world_size:
        own = tier.read_manifest(info, rank)  # SnapshotNotFoundError: this rank's file is on another host
        if _same_layout(own, layout, placement):
            # The trivial plan: the rank's own file, whole (each tensor a piece of itself).
            plan = {t.name: [Piece(rank, t, (Run(0, 0, t.nbytes),))] if t.nbytes else [] for t in own.tensors}
            kept = _read_pieces(tier, info, {rank: own}, plan, view, layout, rank, reserve_staging,
                                staging_free_bytes, replaceable)
            return RestoreResult(info.snapshot_id, info.step, own.metadata_json, sum(t.nbytes for t in own.tensors),
                                 kept, tier.where, info.world_size, (rank,))
        if placement is None or not placement.tensors:
            check_layout(info, own, layout)  # raises, naming the first difference
    read = RECENT.read(tier, info)
    if placement is None or not placement.tensors:  # the trainer's (RestoreRequest.metadata_json)
        raise SnapshotLayoutMismatch(f"{info.path / INDEX_NAME}: {info.snapshot_id} was taken with "
                                     f"world_size {info.world_size}, this job has {world_size}, and the "
                                     "trainer sent no placement of its tensors to reshard it "
                                     "(RestoreRequest.metadata_json): upgrade the swap-state client")
    # The restoring rank's tensors with their placement; the trainer rebuilds its bookkeeping
    # from the restored metadata.
    targets = [TargetTensor(t.name, t.dtype, tuple(t.shape), getattr(meta, "global_shape", None),
                            getattr(meta, "global_offset", None))
               for t in layout.tensors if not t.name.startswith(BOOKKEEPING_PREFIX)
               for meta in [placement.tensors.get(t.name)]]
    targets, index = read.index.promoted(targets)
    plan = index.plan(targets, target_rank=rank, same_world=info.world_size == world_size)
    needed = ranks_needed(plan)
    base = min(needed or info.ranks)
    manifests = {r: read.manifest(r) for r in sorted({*needed, base})}
    plan = bind(plan, {r: m.tensors for r, m in manifests.items()})
    kept = _read_pieces(tier, info, manifests, plan, view, layout, rank, reserve_staging, staging_free_bytes,
                        replaceable)
    nbytes = sum(t.nbytes for t in layout.tensors if t.name in plan)
    metadata = _restored_metadata(manifests[base], [manifests[r] for r in needed if r != base], placement)
    return RestoreResult(info.snapshot_id, info.step, metadata, nbytes, kept, tier.where, info.world_size,
                         tuple(needed), read.planned_from)


def _read_pieces(tier: SnapshotTier, info: SnapshotInfo, manifests: Mapping[int, RankManifest],
                 plan: Mapping[str, list[Piece]], view: memoryview, layout: SegmentLayout, rank: int,
                 reserve_staging, staging_free_bytes, replaceable: bool) -> Kept:
    """Every piece of ``plan`` read once, verified and copied into ``view`` as it is read; what kept the segment's state
    safe meanwhile (:attr:`RestoreResult.kept`). ``replaceable``: the segment holds nothing to keep (a failure zeroes
    the targets). Else the targets' bytes are copied aside first (into the segment's copy slots, idle while no snapshot
    reads it, else into memory the budget lends) and put back on a failure: either way the trainer finds its state
    untouched by a corrupt snapshot. Where neither holds them: verified first, then read again."""
    by_name = {t.name: t for t in layout.tensors}
    by_source = pieces_by_source(plan)
    wanted = plan_reads(plan, manifests)  # only the bytes the runs need, in whole checksum blocks
    base = _posix.buffer_address(view)
    targets = [by_name[name] for name in plan]
    copier = _Copier(base, by_name, by_source)
    if replaceable:
        try:
            stream_tensors(tier, info, wanted, copier)
        except BaseException:  # as fresh as before (a torn one stays marked)
            for target in targets:
                _posix.zero(base + target.offset, target.nbytes)
            raise
        return Kept.NOTHING
    # Aside: the segment's copy slots (idle: no snapshot reads it, checked before), then memory.
    slots_at, slots_left = base + layout.cow_slots_offset, layout.cow_slots * layout.chunk_bytes
    in_slots, overflow = [], []
    for target in (t for t in targets if t.nbytes):
        fits = target.nbytes <= slots_left
        (in_slots if fits else overflow).append(target)
        slots_left -= target.nbytes if fits else 0
    nbytes = sum(t.nbytes for t in overflow)
    reserved = reserve_staging(nbytes) if reserve_staging is not None and nbytes else contextlib.nullcontext(True)
    with reserved as granted:
        if granted:
            with mmap.mmap(-1, max(nbytes, 1)) as memory, memoryview(memory) as memory_view:
                aside = _aside_places(in_slots, slots_at) + _aside_places(overflow, _posix.buffer_address(memory_view))
                _read_with_undo(tier, info, wanted, copier, base, aside)
            return Kept.SLOTS if not overflow else Kept.MEMORY if not in_slots else Kept.SLOTS_MEMORY
    log_event(log, "restore_unstaged", logging.WARNING, snapshot_id=info.snapshot_id, rank=rank,
              kept_bytes=sum(t.nbytes for t in targets), copy_slot_bytes=layout.cow_slots * layout.chunk_bytes,
              budget_free_bytes=staging_free_bytes() if staging_free_bytes else None,
              detail="neither the segment's copy slots nor the budget's free bytes hold the state it keeps: "
              "verifying every checksum first, then reading the snapshot again into the segment (twice the "
              "reads); a larger --cow-budget (or --shm-size) reads it once")
    stream_tensors(tier, info, wanted, lambda *_: None)
    try:
        stream_tensors(tier, info, wanted, copier)
    except SnapshotCorruptError as exc:
        raise SnapshotCorruptError(f"{exc}; it changed while being restored and the segment is "
                              "partially overwritten: restore again") from None
    return Kept.VERIFY_FIRST


def _aside_places(targets, at: int) -> list[tuple[object, int]]:
    """Each target with where its bytes go aside, one after the other from ``at``."""
    return list(zip(targets, itertools.accumulate((t.nbytes for t in targets[:-1]), initial=at)))


def _read_with_undo(tier: SnapshotTier, info: SnapshotInfo, wanted, copier: _Copier, base: int,
                    aside: Sequence[tuple[object, int]]) -> None:
    """Stream into the targets, each copied aside (target, where) by a thread before its first
    write (memory is faster than the disk: it stays ahead); all put back if the restore fails."""
    ready = {target.name: threading.Event() for target, _ in aside}

    def copy_aside() -> None:
        for target, kept in aside:
            _posix.memmove(kept, base + target.offset, target.nbytes)
            ready[target.name].set()

    thread = threading.Thread(target=copy_aside, name="restore-aside", daemon=True)
    thread.start()
    copier.before_write = lambda name: ready[name].wait()
    try:
        stream_tensors(tier, info, wanted, copier)
    except BaseException:
        thread.join()
        for target, kept in aside:  # each target as it was (those not written are too)
            _posix.memmove(base + target.offset, kept, target.nbytes)
        raise
    finally:
        thread.join()


class _Copier:
    """A :data:`~.restore_reads.Deliver`: the bytes of a source tensor, as they come, into the runs of
    the target tensors they fill (``before_write(target)`` first, when set)."""

    def __init__(self, base: int, by_name: Mapping, by_source: Mapping[tuple[int, str], list[tuple[str, Piece]]]):
        # Per source tensor: (target name, target address, its runs by source offset, their starts).
        self._runs: dict[tuple[int, str], list[tuple[str, int, list[Run], list[int]]]] = {}
        for key, items in by_source.items():
            for name, piece in items:
                runs = sorted(piece.runs, key=lambda run: run.source_offset)
                self._runs.setdefault(key, []).append(
                    (name, base + by_name[name].offset, runs, [run.source_offset for run in runs]))
        self.before_write: Callable[[str], None] | None = None

    def __call__(self, key: tuple[int, str], offset: int, address: int, nbytes: int) -> None:
        end = offset + nbytes
        for name, target, runs, starts in self._runs.get(key, ()):
            first = max(0, bisect.bisect_right(starts, offset) - 1)
            for run in itertools.islice(runs, first, None):
                if run.source_offset >= end:
                    break
                lo, hi = max(run.source_offset, offset), min(run.source_offset + run.nbytes, end)
                if hi <= lo:
                    continue
                if self.before_write is not None:
                    self.before_write(name)
                _posix.memmove(target + run.target_offset + lo - run.source_offset, address + lo - offset, hi - lo)


class ReadSnapshot:
    """A snapshot's layout index and manifests, each verified, shared by this server's restoring ranks."""

    def __init__(self, tier: SnapshotTier, info: SnapshotInfo):
        self._tier, self._info = tier, info
        self._lock = threading.Lock()
        self._manifests: dict[int, RankManifest] = {}
        raw = tier.read_layout(info)
        self.planned_from = PlanSource.LAYOUT_INDEX if raw is not None else PlanSource.EVERY_MANIFEST
        if raw is None and isinstance(tier, StoredSnapshots):  # not yet published: the hosts' parts
            prefix = tier.step_prefix(info.job_id, info.step)
            found = tier.host_parts(info.job_id, info.step, tier.list_step(info.job_id, info.step), info.world_size)
            try:
                if found is not None and found[0].files == info.index.files:
                    self.index, self.planned_from = parts_layout(tier, prefix, found[1], info.world_size), PlanSource.LAYOUT_INDEX
                    log_event(log, "restore_layout_from_parts", snapshot_id=info.snapshot_id, hosts=len(found[1]),
                              detail="the step has no layout.json yet: merged from its hosts' parts")
                    return
                why = "its host parts are missing or not its files (written before them, or uploaded again)"
            except ValueError as exc:
                why = str(exc)
            log_event(log, "restore_every_manifest", logging.WARNING, snapshot_id=info.snapshot_id,
                      ranks=info.world_size, detail=f"no layout.json, and {why}: every rank's manifest is read")
        if raw is None:  # written before layout indexes, or a step read from the store's markers
            self._manifests = {r: tier.read_manifest(info, r) for r in info.ranks}
            self.index = LayoutIndex({r: m.tensors for r, m in self._manifests.items()}, info.world_size)
            return
        try:
            self.index = LayoutIndex.from_bytes(raw, info.world_size)
        except ValueError as exc:
            raise SnapshotCorruptError(f"{info.path / LAYOUT_NAME} is not a valid layout index: {exc}") from None

    def manifest(self, rank: int) -> RankManifest:
        """Old rank ``rank``'s manifest, read once."""
        with self._lock:
            found = self._manifests.get(rank)
        if found is None:
            found = self._tier.read_manifest(self._info, rank)
            with self._lock:
                found = self._manifests.setdefault(rank, found)
        return found


class RecentSnapshots:
    """The snapshots assembled from lately, read once for the ranks of this server that restore
    them together. An entry lives while a restore uses it and ``keep_s`` after its last read,
    never longer: one planned from every manifest is about a GiB at 1,024 old ranks."""

    def __init__(self, keep_s: float = 30.0):
        self._keep_s = keep_s
        self._lock = threading.Lock()
        self._live: weakref.WeakValueDictionary[tuple, ReadSnapshot] = weakref.WeakValueDictionary()
        self._loading: dict[tuple, threading.Lock] = {}  # per snapshot: held while one rank reads it
        self._kept: ReadSnapshot | None = None
        self._kept_count = 0  # which keep a release timer ends (the timer holds no reference)
        self._release: threading.Timer | None = None

    def read(self, tier: SnapshotTier, info: SnapshotInfo) -> ReadSnapshot:
        # A snapshot replaced under the same id (a step trained again) has another index: its
        # files' checksums, its attempt and time.
        key = (tier.where, str(info.path), info.index)
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        # The first rank reads while the others of this snapshot wait for it and share the
        # result; restores of other snapshots do not wait (a store's N reads take a while).
        with loading:
            try:
                with self._lock:
                    read = self._live.get(key)
                if read is None:
                    read = ReadSnapshot(tier, info)
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


def _restored_metadata(base: RankManifest, others: Sequence[RankManifest], placement: SnapshotMetadata) -> str:
    """The snapshot's metadata as Restore returns it: the old rank ``base``'s, completed by the
    per-parameter entries of the ``others`` read (a pipeline stage holds only its own), with the
    restoring rank's own tensor entries (after a reshard the old offsets are not its own)."""
    raw = base.metadata_fields()
    for other in others:
        for key, entries in other.metadata_fields().items():
            if isinstance(entries, dict):
                raw[key] = {**entries, **raw.get(key, {})}
    return json.dumps({"tensors": json.loads(placement.raw).get("tensors", {}), **raw}, allow_nan=False)
