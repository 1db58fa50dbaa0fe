"""Plans the byte copies that reshard a snapshot to another world size (:func:`plan_tensor`): which old ranks' tensors
to read (:class:`Piece`) and which byte ranges of them go where (:class:`Run`), a DTensor shard being the row-major box
``[global_offset, global_offset + shape)``. Pure Python. Rules: dtypes and global shapes match; replicas count once (the
restoring rank's own, else one spread by rank); shards tile the target box exactly; a plain tensor is taken whole from
one old rank, only when all hold the same bytes (crc32) or at the snapshot's own world size."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from swap_state.common.dtypes import DTYPE_ITEMSIZE
from swap_state.common.snapshot_errors import SnapshotLayoutMismatch
from swap_state.common.snapshot_format import TensorRecord

__all__ = ["Piece", "Run", "TargetTensor", "plan_tensor", "ranks_needed"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # a box of a global tensor as (offset, shape)


@dataclasses.dataclass(frozen=True)
class TargetTensor:
    """One tensor of the restoring rank's segment."""

    name: str  # the old ranks' records of this name are its sources
    dtype: str  # ``float32``, ``bfloat16``, ...: the sources must have the same
    shape: tuple[int, ...]
    global_shape: tuple[int, ...] | None  # a DTensor's; None for a plain tensor
    global_offset: tuple[int, ...] | None  # of the new rank's shard in the global tensor; None for a plain tensor


@dataclasses.dataclass(frozen=True)
class Run:
    """One contiguous byte copy from a source tensor into the target tensor."""

    source_offset: int  # inside the source tensor's bytes (not the file: add ``data_offsets[0]``)
    target_offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one old rank's tensor contributes to a target tensor."""

    source_rank: int
    source: TensorRecord  # that rank's record of the tensor (its ``data_offsets`` locate it in the file)
    runs: tuple[Run, ...]  # ascending ``target_offset``


def plan_tensor(target: TargetTensor, sources: Sequence[tuple[int, TensorRecord]], *,
                target_rank: int | None = None, same_world: bool = False) -> list[Piece]:
    """The pieces that fill ``target``, by source rank, from ``sources`` (old rank, its record).
    ``same_world``: a plain tensor whose bytes differ between ranks is ``target_rank``'s own.
    Raises SnapshotLayoutMismatch when the sources cannot fill the target."""
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


def _nearest(holders: Sequence[tuple[int, TensorRecord]], target_rank: int | None) -> tuple[int, TensorRecord]:
    """Which old rank holding the same bytes a new rank reads: its own, else one spread by rank (None: the first)."""
    return next((pair for pair in holders if pair[0] == target_rank), holders[(target_rank or 0) % len(holders)])


def ranks_needed(plan: Mapping[str, list[Piece]]) -> list[int]:
    return sorted({piece.source_rank for pieces in plan.values() for piece in pieces})


def _check_source(target: TargetTensor, rank: int, record: TensorRecord, itemsize: int) -> None:
    """Dtype, kind (DTensor or plain), global shape and byte size of one source."""
    name = target.name
    if record.dtype != target.dtype:
        raise SnapshotLayoutMismatch(f"tensor {name}: old rank {rank} saved it as {record.dtype} but the restoring "
                                     f"segment has {target.dtype}; restore with the dtype the snapshot was taken with")
    if record.global_shape != target.global_shape:
        if record.global_shape is None or target.global_shape is None:
            kinds = ("a plain tensor", "a DTensor")
            saved, wanted = (kinds if record.global_shape is None else kinds[::-1])
            raise SnapshotLayoutMismatch(f"tensor {name}: old rank {rank} saved it as {saved} but the "
                                         f"restoring segment has {wanted}")
        raise SnapshotLayoutMismatch(f"tensor {name}: global shape {record.global_shape} in old rank {rank} "
                                     f"but {target.global_shape} in the restoring job; the model config " "must match")
    # The runs address the source's bytes by its shape; a record whose size disagrees would
    # send them past the tensor's end.
    if record.nbytes != math.prod(record.shape) * itemsize:
        raise SnapshotLayoutMismatch(f"tensor {name}: old rank {rank} records {record.nbytes} bytes for "
                                     f"shape {record.shape} of {record.dtype}")
    if record.global_shape is None:
        if record.shape != target.shape:
            raise SnapshotLayoutMismatch(f"tensor {name}: plain tensor of shape {record.shape} in old rank {rank} but "
                                         f"{target.shape} in the restoring segment; the model config must match")
        return
    _check_box(name, f"old rank {rank}", record.global_shape, record.global_offset, record.shape)


def _check_box(name: str, where: str, global_shape: tuple[int, ...], offset: tuple[int, ...] | None,
               shape: tuple[int, ...]) -> None:
    if offset is None or len(offset) != len(shape) or len(shape) != len(global_shape):
        raise SnapshotLayoutMismatch(f"tensor {name}: the DTensor shard of {where} has global shape {global_shape}, "
                                     f"offset {offset} and local shape {shape}, which do not describe a box")
    if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offset, shape, global_shape)):
        raise SnapshotLayoutMismatch(f"tensor {name}: the DTensor shard of {where} (offset {offset}, shape "
                                     f"{shape}) lies outside the global shape {global_shape}")


def _plan_plain(target: TargetTensor, ordered: Sequence[tuple[int, TensorRecord]], itemsize: int,
                target_rank: int | None, same_world: bool) -> list[Piece]:
    if target.global_offset is not None:
        raise SnapshotLayoutMismatch(f"tensor {target.name}: the restoring segment gives it a global offset "
                                     f"{target.global_offset} but no global shape")
    nbytes = math.prod(target.shape) * itemsize
    if nbytes == 0:
        return []
    first_rank, first = ordered[0]
    differing = next((pair for pair in ordered if pair[1].crc32 != first.crc32), None)
    if differing is not None and not (same_world and any(rank == target_rank for rank, _ in ordered)):
        raise SnapshotLayoutMismatch(f"tensor {target.name} is a plain (non-DTensor) tensor that differs between the "
                                     f"snapshot's ranks ({first_rank} and {differing[0]}), so it cannot be resharded "
                                     "to another world size; restore at the snapshot's world size")
    rank, record = _nearest(ordered, target_rank)  # the rank's own where they differ
    return [Piece(rank, record, (Run(0, 0, nbytes),))]


def _plan_dtensor(target: TargetTensor, ordered: Sequence[tuple[int, TensorRecord]], itemsize: int,
                  target_rank: int | None) -> list[Piece]:
    assert target.global_shape is not None
    _check_box(target.name, "the restoring rank", target.global_shape, target.global_offset, target.shape)
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
    chosen = [(*_nearest(holders, target_rank), common) for box, holders in boxes.items()
              if (common := _intersect(box, target_box)) is not None]
    _check_tiling(target, chosen)
    return [Piece(rank, record, _runs(common, (record.global_offset, record.shape), target_box, itemsize))
            for rank, record, common in sorted(chosen, key=lambda item: item[0])]


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
            raise SnapshotLayoutMismatch(f"tensor {target.name}: overlapping shards of old ranks {rank_a} "
                                         f"and {rank_b} (offset {box_a[0]} shape {box_a[1]}, offset "
                                         f"{box_b[0]} shape {box_b[1]}) that are not replicas of each "
                                         "other; the snapshot's layout is inconsistent")
    covered = sum(math.prod(box[1]) for _, _, box in chosen)
    wanted = math.prod(target.shape)
    if covered != wanted:
        raise SnapshotLayoutMismatch(f"tensor {target.name}: the restoring rank's box (offset {target.global_offset}, "
                                     f"shape {target.shape}) is not covered: the snapshot's shards hold {covered} of "
                                     f"its {wanted} elements; check that the snapshot holds every old rank")


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _runs(common: Box, source: Box, target: Box, itemsize: int) -> tuple[Run, ...]:
    """The contiguous copies that move box ``common`` from the source box into the target."""
    lo, ext = common
    ndim = len(ext)
    if ndim == 0:
        return (Run(0, 0, itemsize),)
    (s_off, s_shape), (t_off, t_shape) = source, target
    # Past dim k the common box spans whole rows of both local boxes, so each index prefix of
    # the dims before k is one contiguous range in both; k is the smallest such dim.
    k = next((d for d in range(ndim - 1, 0, -1) if not ext[d] == s_shape[d] == t_shape[d]), 0)
    s_strides, t_strides = _strides(s_shape), _strides(t_shape)
    nbytes = ext[k] * math.prod(ext[k + 1:]) * itemsize
    # Dims past k start at the local boxes' own origin (they are spanned whole): they add 0.
    s_base = (lo[k] - s_off[k]) * s_strides[k]
    t_base = (lo[k] - t_off[k]) * t_strides[k]
    axes = [[((i - s_off[d]) * s_strides[d], (i - t_off[d]) * t_strides[d]) for i in range(lo[d], lo[d] + ext[d])]
            for d in range(k)]
    # The minimal k leaves no two runs adjacent in both boxes: each prefix is one copy.
    return tuple(Run((s_base + sum(p[0] for p in prefix)) * itemsize,
                     (t_base + sum(p[1] for p in prefix)) * itemsize, nbytes)
                 for prefix in itertools.product(*axes))
