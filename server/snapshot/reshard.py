"""Plans the byte copies that reshard a snapshot to another world size.

A snapshot holds, per old rank, a safetensors file whose tensors its manifest describes
(:class:`~swap_state.common.snapshot_format.TensorRecord`). A DTensor shard is the box
``[global_offset, global_offset + shape)`` of its global tensor, stored row-major (C order).
A job restarting at another world size needs, for each tensor of a *new* rank, bytes
assembled from the old ranks' shards: :func:`plan_rank` says, for every tensor of the
restoring rank, which old ranks' tensors to read (:class:`Piece`) and which contiguous byte
ranges of them go where in the target tensor (:class:`Run`).

The planner only plans: it reads no file and copies no byte. It is pure Python on plain ints
(no torch, no numpy), since the server package must not import torch; the caller reads the
source ranges (``data_offsets[0] + run.source_offset``) and writes them into the target.

Rules, briefly: dtypes and global shapes must match; replicas (old ranks holding the same
box) count once, the restoring rank's own serving when it holds one, else one spread by the
restoring rank; the chosen shards must not overlap and must cover the target box exactly. A plain (non-DTensor) tensor is taken whole from one old rank, which
is only sound when all ranks hold the same bytes (equal crc32s), or when restoring at the
snapshot's own world size, where each rank takes its own. :class:`LayoutIndex` plans a new
rank in O(T log N) (T tensors, N old ranks).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from swap_state.common.dtypes import DTYPE_ITEMSIZE
from swap_state.common.snapshot_errors import SnapshotLayoutMismatch
from swap_state.common.snapshot_format import TensorRecord

__all__ = ["LayoutIndex", "Piece", "Run", "TargetTensor", "plan_rank", "plan_tensor", "ranks_needed"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of a global tensor as (offset, shape)."""


@dataclasses.dataclass(frozen=True)
class TargetTensor:
    """One tensor of the restoring rank's segment."""

    name: str
    """The segment tensor name; the old ranks' records of this name are its sources."""
    dtype: str
    """Segment dtype name (``float32``, ``bfloat16``, ...); the sources must have the same."""
    shape: tuple[int, ...]
    """Local shape on the new rank."""
    global_shape: tuple[int, ...] | None
    """DTensor global shape; None for a plain (non-DTensor) tensor."""
    global_offset: tuple[int, ...] | None
    """DTensor offset of the new rank's shard in the global tensor; None for a plain tensor."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One contiguous byte copy from a source tensor into the target tensor."""

    source_offset: int
    """Byte offset inside the source tensor's bytes (not the file: add ``data_offsets[0]``)."""
    target_offset: int
    """Byte offset inside the target tensor's bytes."""
    nbytes: int
    """Bytes to copy."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one old rank's tensor contributes to a target tensor."""

    source_rank: int
    """The old rank whose file holds the source tensor."""
    source: TensorRecord
    """That rank's record of the tensor (its ``data_offsets`` locate it in the file)."""
    runs: tuple[Run, ...]
    """Contiguous byte copies, ascending ``target_offset``."""


def plan_tensor(
    target: TargetTensor,
    sources: Sequence[tuple[int, TensorRecord]],
    *,
    target_rank: int | None = None,
    same_world: bool = False,
) -> list[Piece]:
    """The pieces that fill ``target``, ordered by source rank.

    ``sources``: (old rank, that rank's record of the tensor with the same name), any order.
    ``same_world`` with ``target_rank``: the restore keeps the snapshot's world size, so a
    plain tensor whose bytes differ between ranks is taken from ``target_rank``'s own file.
    Raises SnapshotLayoutMismatch when the sources cannot fill the target.
    """
    name = target.name
    if not sources:
        raise SnapshotLayoutMismatch(f"tensor {name}: no rank of the snapshot holds it")
    itemsize = DTYPE_ITEMSIZE.get(target.dtype)
    if itemsize is None:
        raise SnapshotLayoutMismatch(f"tensor {name}: dtype {target.dtype!r} is not supported")
    ordered = sorted(sources, key=lambda pair: pair[0])
    for rank, record in ordered:
        _check_source(target, rank, record, itemsize)
    if target.global_shape is None:
        return _plan_plain(target, ordered, itemsize, target_rank, same_world)
    return _plan_dtensor(target, ordered, itemsize, target_rank)


def plan_rank(
    targets: Sequence[TargetTensor],
    manifests: Mapping[int, Sequence[TensorRecord]],
    *,
    target_rank: int,
    same_world: bool,
) -> dict[str, list[Piece]]:
    """For every target tensor (by name) its pieces; ``manifests``: old rank -> its tensors.
    One new rank's plan from a :class:`LayoutIndex` built for it; build the index once and
    call :meth:`LayoutIndex.plan` when several new ranks restore the same snapshot."""
    return LayoutIndex(manifests).plan(targets, target_rank=target_rank, same_world=same_world)


class LayoutIndex:
    """Every old rank's tensors of one snapshot, indexed once for any number of new ranks.

    Per tensor name: its records, ascending old rank, and, when the shards are uniform (one
    dtype and global shape, valid boxes) and tile the global tensor as a grid (every layout
    DTensor makes: Shard, _StridedShard, several mesh dims, uneven or empty last shards), an
    interval index per dimension. Building is O(records log N) for N old ranks; planning one
    new rank's T tensors is O(T log N) plus the pieces it yields, and a grid needs no
    completeness check (its boxes partition the tensor: checked once, here). A tensor that is
    not such a grid, or whose records disagree, is planned by :func:`plan_tensor`, which
    checks every source and says what is wrong.

    Each target tensor comes from the old ranks that hold it: all of them (data parallel,
    tensor parallel), some, or one (a pipeline stage's, an expert's). A target tensor that no
    old rank holds is refused, naming it: resharding moves the snapshot's tensors, it never
    invents one. An old tensor the restoring rank lacks belongs to another new rank (another
    pipeline stage): nothing here can tell a dropped one from that.
    """

    def __init__(self, manifests: Mapping[int, Sequence[TensorRecord]]):
        if not manifests:
            raise SnapshotLayoutMismatch("the snapshot has no ranks to restore from")
        holders: dict[str, list[tuple[int, TensorRecord]]] = {}
        for rank in sorted(manifests):
            for name, record in _by_name(rank, manifests[rank]).items():
                holders.setdefault(name, []).append((rank, record))
        self._tensors = {name: _TensorIndex(pairs) for name, pairs in holders.items()}

    def records(self, name: str) -> list[tuple[int, TensorRecord]]:
        """(old rank, record) of every old rank holding ``name``, ascending rank."""
        found = self._tensors.get(name)
        return list(found.ordered) if found is not None else []

    def replaced(self, records: Mapping[str, list[tuple[int, TensorRecord]]]) -> LayoutIndex:
        """This index with the records of some tensors replaced (indexed anew, the rest shared)."""
        copy = object.__new__(LayoutIndex)
        copy._tensors = {**self._tensors, **{name: _TensorIndex(sorted(pairs, key=lambda p: p[0]))
                                             for name, pairs in records.items()}}
        return copy

    def plan(self, targets: Sequence[TargetTensor], *, target_rank: int, same_world: bool) -> dict[str, list[Piece]]:
        """Every target tensor's pieces (by name). ``same_world``: the restore keeps the
        snapshot's world size (a plain tensor differing between ranks is then each rank's own)."""
        names: set[str] = set()
        for target in targets:
            if target.name in names:
                raise SnapshotLayoutMismatch(
                    f"tensor {target.name} appears twice in the restoring rank's segment"
                )
            names.add(target.name)
        missing = sorted(names - self._tensors.keys())
        if missing:
            raise SnapshotLayoutMismatch(
                f"tensor {missing[0]} is in no rank of the snapshot ({len(missing)} such in all); "
                "restore into a job with the same model and optimizer state as the snapshot's"
            )
        return {target.name: self._tensors[target.name].plan(target, target_rank, same_world) for target in targets}


class _TensorIndex:
    """One tensor's records (ascending old rank) and, when they allow, its fast plan."""

    def __init__(self, ordered: list[tuple[int, TensorRecord]]):
        self.ordered = ordered
        first = ordered[0][1]
        self.uniform = _uniform(ordered)
        self.same_bytes = self.uniform and all(record.crc32 == first.crc32 for _, record in ordered)
        self.grid = _Grid.of(first.global_shape, ordered) if self.uniform and first.global_shape is not None else None

    def plan(self, target: TargetTensor, target_rank: int, same_world: bool) -> list[Piece]:
        first = self.ordered[0][1]
        if self.uniform and target.dtype == first.dtype and target.global_shape == first.global_shape:
            itemsize = DTYPE_ITEMSIZE[target.dtype]
            if target.global_shape is None and target.global_offset is None and target.shape == first.shape \
                    and self.same_bytes:
                nbytes = math.prod(target.shape) * itemsize
                rank, record = _nearest(self.ordered, target_rank)
                return [Piece(rank, record, (Run(0, 0, nbytes),))] if nbytes else []
            if self.grid is not None:
                _check_box(target.name, "the restoring rank", target.global_shape, target.global_offset,
                           target.shape)
                return self.grid.pieces(target, itemsize, target_rank)
        return plan_tensor(target, self.ordered, target_rank=target_rank, same_world=same_world)


def _uniform(ordered: Sequence[tuple[int, TensorRecord]]) -> bool:
    """One supported dtype and global shape, sizes that match, boxes inside the tensor."""
    first = ordered[0][1]
    itemsize = DTYPE_ITEMSIZE.get(first.dtype)
    if itemsize is None:
        return False
    for rank, record in ordered:
        if record.dtype != first.dtype or record.global_shape != first.global_shape \
                or record.nbytes != math.prod(record.shape) * itemsize:
            return False
        if record.global_shape is None:
            if record.shape != first.shape:
                return False
            continue
        try:
            _check_box(record.name, f"old rank {rank}", record.global_shape, record.global_offset, record.shape)
        except SnapshotLayoutMismatch:
            return False
    return True


def _nearest(holders: Sequence[tuple[int, TensorRecord]], target_rank: int) -> tuple[int, TensorRecord]:
    """Which of several old ranks holding the same bytes a new rank reads: its own rank's
    file when that holds them, else one spread by the new rank (not all from the lowest)."""
    for pair in holders:
        if pair[0] == target_rank:
            return pair
    return holders[target_rank % len(holders)]


class _Grid:
    """The distinct non-empty boxes of a tensor when they partition it as a grid: along each
    dimension the boxes' intervals tile ``[0, size)``, and every combination of intervals is
    one box (replicas: several old ranks holding the same box)."""

    def __init__(self, starts: list[list[int]], cells: dict[tuple[int, ...], list[tuple[int, TensorRecord]]]):
        self.starts = starts
        self.cells = cells

    @classmethod
    def of(cls, global_shape: tuple[int, ...], ordered: Sequence[tuple[int, TensorRecord]]) -> _Grid | None:
        boxes: dict[Box, list[tuple[int, TensorRecord]]] = {}
        for rank, record in ordered:
            if math.prod(record.shape):
                boxes.setdefault((tuple(record.global_offset), tuple(record.shape)), []).append((rank, record))
        if not boxes:
            return None
        starts: list[list[int]] = []
        for d, size in enumerate(global_shape):
            intervals = sorted({(offset[d], shape[d]) for offset, shape in boxes})
            end = 0
            for start, length in intervals:
                if start != end:
                    return None  # a gap or an overlap along this dimension
                end = start + length
            if end != size:
                return None
            starts.append([start for start, _ in intervals])
        if len(boxes) != math.prod(len(s) for s in starts):
            return None  # not every combination of intervals is a box
        where = [{start: i for i, start in enumerate(s)} for s in starts]
        cells = {tuple(where[d][offset[d]] for d in range(len(starts))): holders
                 for (offset, _), holders in boxes.items()}
        return cls(starts, cells)

    def pieces(self, target: TargetTensor, itemsize: int, target_rank: int) -> list[Piece]:
        if math.prod(target.shape) == 0:
            return []
        target_box = (target.global_offset, target.shape)
        ranges = [range(bisect.bisect_right(s, lo) - 1, bisect.bisect_left(s, lo + n))
                  for s, lo, n in zip(self.starts, target.global_offset, target.shape)]
        pieces = []
        for cell in itertools.product(*ranges):
            rank, record = _nearest(self.cells[cell], target_rank)
            source_box = (record.global_offset, record.shape)
            common = _intersect(source_box, target_box)
            if common is not None:
                pieces.append(Piece(rank, record, _runs(common, source_box, target_box, itemsize)))
        pieces.sort(key=lambda piece: piece.source_rank)
        return pieces


def ranks_needed(plan: Mapping[str, list[Piece]]) -> list[int]:
    """The distinct old ranks a plan reads from, sorted: the files a restore must open."""
    return sorted({piece.source_rank for pieces in plan.values() for piece in pieces})


def _by_name(rank: int, records: Sequence[TensorRecord]) -> dict[str, TensorRecord]:
    found: dict[str, TensorRecord] = {}
    for record in records:
        if record.name in found:
            raise SnapshotLayoutMismatch(
                f"tensor {record.name} appears twice in the manifest of old rank {rank}"
            )
        found[record.name] = record
    return found


def _check_source(target: TargetTensor, rank: int, record: TensorRecord, itemsize: int) -> None:
    """Dtype, kind (DTensor or plain), global shape and byte size of one source."""
    name = target.name
    if record.dtype != target.dtype:
        raise SnapshotLayoutMismatch(
            f"tensor {name}: old rank {rank} saved it as {record.dtype} but the restoring "
            f"segment has {target.dtype}; restore with the dtype the snapshot was taken with"
        )
    if record.global_shape != target.global_shape:
        if record.global_shape is None or target.global_shape is None:
            kinds = ("a plain tensor", "a DTensor")
            saved, wanted = (kinds if record.global_shape is None else kinds[::-1])
            raise SnapshotLayoutMismatch(
                f"tensor {name}: old rank {rank} saved it as {saved} but the restoring "
                f"segment has {wanted}"
            )
        raise SnapshotLayoutMismatch(
            f"tensor {name}: global shape {record.global_shape} in old rank {rank} but "
            f"{target.global_shape} in the restoring job; the model config must match"
        )
    # The runs address the source's bytes by its shape; a record whose size disagrees would
    # send them past the tensor's end.
    if record.nbytes != math.prod(record.shape) * itemsize:
        raise SnapshotLayoutMismatch(
            f"tensor {name}: old rank {rank} records {record.nbytes} bytes for shape "
            f"{record.shape} of {record.dtype}"
        )
    if record.global_shape is None:
        if record.shape != target.shape:
            raise SnapshotLayoutMismatch(
                f"tensor {name}: plain tensor of shape {record.shape} in old rank {rank} but "
                f"{target.shape} in the restoring segment; the model config must match"
            )
        return
    _check_box(name, f"old rank {rank}", record.global_shape, record.global_offset, record.shape)


def _check_box(
    name: str,
    where: str,
    global_shape: tuple[int, ...],
    offset: tuple[int, ...] | None,
    shape: tuple[int, ...],
) -> None:
    if offset is None or len(offset) != len(shape) or len(shape) != len(global_shape):
        raise SnapshotLayoutMismatch(
            f"tensor {name}: the DTensor shard of {where} has global shape {global_shape}, "
            f"offset {offset} and local shape {shape}, which do not describe a box"
        )
    if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offset, shape, global_shape)):
        raise SnapshotLayoutMismatch(
            f"tensor {name}: the DTensor shard of {where} (offset {offset}, shape {shape}) "
            f"lies outside the global shape {global_shape}"
        )


def _plan_plain(
    target: TargetTensor,
    ordered: Sequence[tuple[int, TensorRecord]],
    itemsize: int,
    target_rank: int | None,
    same_world: bool,
) -> list[Piece]:
    if target.global_offset is not None:
        raise SnapshotLayoutMismatch(
            f"tensor {target.name}: the restoring segment gives it a global offset "
            f"{target.global_offset} but no global shape"
        )
    nbytes = math.prod(target.shape) * itemsize
    if nbytes == 0:
        return []
    first_rank, first = ordered[0]
    chosen = _nearest(ordered, target_rank) if target_rank is not None else (first_rank, first)
    differing = next((pair for pair in ordered if pair[1].crc32 != first.crc32), None)
    if differing is not None:
        own = [pair for pair in ordered if pair[0] == target_rank]
        if not (same_world and own):
            raise SnapshotLayoutMismatch(
                f"tensor {target.name} is a plain (non-DTensor) tensor that differs between "
                f"the snapshot's ranks ({first_rank} and {differing[0]}), so it cannot be "
                "resharded to another world size; restore at the snapshot's world size"
            )
        chosen = own[0]
    return [Piece(chosen[0], chosen[1], (Run(0, 0, nbytes),))]


def _plan_dtensor(
    target: TargetTensor, ordered: Sequence[tuple[int, TensorRecord]], itemsize: int, target_rank: int | None
) -> list[Piece]:
    assert target.global_shape is not None
    _check_box(target.name, "the restoring rank", target.global_shape, target.global_offset,
               target.shape)
    assert target.global_offset is not None
    if math.prod(target.shape) == 0:
        return []
    target_box = (target.global_offset, target.shape)
    # Replicas hold the same box; reading it once, from the nearest holder, is enough.
    boxes: dict[Box, list[tuple[int, TensorRecord]]] = {}
    for rank, record in ordered:
        assert record.global_offset is not None
        if math.prod(record.shape):
            boxes.setdefault((record.global_offset, record.shape), []).append((rank, record))
    chosen: list[tuple[int, TensorRecord, Box]] = []
    for box, holders in boxes.items():
        rank, record = _nearest(holders, target_rank) if target_rank is not None else holders[0]
        common = _intersect(box, target_box)
        if common is not None:
            chosen.append((rank, record, common))
    _check_tiling(target, chosen)
    return [
        Piece(rank, record, _runs(common, (record.global_offset, record.shape), target_box,
                                  itemsize))
        for rank, record, common in sorted(chosen, key=lambda item: item[0])
    ]


def _intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``; None when empty. A 0-dim box is one element."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _check_tiling(target: TargetTensor, chosen: Sequence[tuple[int, TensorRecord, Box]]) -> None:
    """The chosen boxes must be disjoint and fill the target box exactly."""
    for (rank_a, _, box_a), (rank_b, _, box_b) in itertools.combinations(chosen, 2):
        if _intersect(box_a, box_b) is not None:
            raise SnapshotLayoutMismatch(
                f"tensor {target.name}: overlapping shards of old ranks {rank_a} and {rank_b} "
                f"(offset {box_a[0]} shape {box_a[1]}, offset {box_b[0]} shape {box_b[1]}) "
                "that are not replicas of each other; the snapshot's layout is inconsistent"
            )
    covered = sum(math.prod(box[1]) for _, _, box in chosen)
    wanted = math.prod(target.shape)
    if covered != wanted:
        raise SnapshotLayoutMismatch(
            f"tensor {target.name}: the restoring rank's box (offset {target.global_offset}, "
            f"shape {target.shape}) is not covered: the snapshot's shards hold {covered} of "
            f"its {wanted} elements; check that the snapshot holds every old rank"
        )


def _strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major element strides."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def _runs(common: Box, source: Box, target: Box, itemsize: int) -> tuple[Run, ...]:
    """The contiguous copies that move box ``common`` from the source box into the target."""
    lo, ext = common
    ndim = len(ext)
    if ndim == 0:
        return (Run(0, 0, itemsize),)
    (s_off, s_shape), (t_off, t_shape) = source, target
    # Past dim k the common box spans whole rows of both local boxes, so each index prefix of
    # the dims before k is one contiguous range in both; k is the smallest such dim.
    k = 0
    for d in range(ndim - 1, 0, -1):
        if not ext[d] == s_shape[d] == t_shape[d]:
            k = d
            break
    s_strides, t_strides = _strides(s_shape), _strides(t_shape)
    nbytes = ext[k] * math.prod(ext[k + 1:]) * itemsize
    # Dims past k start at the local boxes' own origin (they are spanned whole): they add 0.
    s_base = (lo[k] - s_off[k]) * s_strides[k]
    t_base = (lo[k] - t_off[k]) * t_strides[k]
    axes = [
        [((i - s_off[d]) * s_strides[d], (i - t_off[d]) * t_strides[d])
         for i in range(lo[d], lo[d] + ext[d])]
        for d in range(k)
    ]
    runs: list[Run] = []
    cur_s = cur_t = cur_n = -1
    for prefix in itertools.product(*axes):
        s = (s_base + sum(p[0] for p in prefix)) * itemsize
        t = (t_base + sum(p[1] for p in prefix)) * itemsize
        if cur_n >= 0 and cur_s + cur_n == s and cur_t + cur_n == t:
            # Adjacent in both: one copy does it. The minimal k leaves none such, but the
            # check is cheap and keeps the runs minimal should the rule for k change.
            cur_n += nbytes
            continue
        if cur_n >= 0:
            runs.append(Run(cur_s, cur_t, cur_n))
        cur_s, cur_t, cur_n = s, t, nbytes
    runs.append(Run(cur_s, cur_t, cur_n))
    return tuple(runs)
