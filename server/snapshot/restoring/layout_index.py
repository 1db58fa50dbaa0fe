"""One step's layout index (``layout.json``): for every tensor, where each old rank's shard lies, so
a restore at another world size or layout plans from one small object (DCP's ``.metadata`` is
the model), not from N manifests. A DTensor's shards form a grid stored as arithmetic runs
(:class:`Progression`): small at any N, planning a rank is O(T log R). Call order (:mod:`.restore`)::

    targets, index = LayoutIndex.from_bytes(raw, world_size).promoted(targets)
    plan = bind(index.plan(targets, target_rank=..., same_world=...), {rank: manifest.tensors, ...})
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence

from swap_state.common.dtypes import DTYPE_ITEMSIZE
from swap_state.common.snapshot_errors import SnapshotCorruptError, SnapshotLayoutMismatch
from swap_state.common.snapshot_format import TensorRecord

from swap_state.server.snapshot.restoring.reshard import (
    Piece, TargetTensor, _check_box, _intersect, _runs, _strides, plan_tensor)

__all__ = ["LAYOUT_FORMAT", "LayoutIndex", "Progression", "bind", "layout_part"]

LAYOUT_FORMAT = "swap-state-layout"
LAYOUT_VERSION = 2  # 2: runs of runs (first, step, count, times, shift)
_ABSENT = -1  # an owner or checksum run's value for a rank that holds nothing of the tensor
_MAX_INT = 1 << 62


class Progression:
    """A sequence of ints stored as runs ``(first, step, count, times, shift)``: ``count`` values
    from ``first`` by ``step``, all that ``times`` over, ``first`` moved by ``shift`` each time
    (TP inside FSDP numbers a tensor's shards so: one run, not one per TP group)."""

    __slots__ = ("runs", "_ends")

    def __init__(self, runs: Sequence[tuple[int, int, int, int, int]]):
        self.runs = tuple(runs)
        self._ends = list(itertools.accumulate(count * times for _, _, count, times, _ in self.runs))

    @classmethod
    def of(cls, values: Sequence[int]) -> Progression:
        runs: list[tuple[int, int, int, int, int]] = []
        i = 0
        while i < len(values):
            step = values[i + 1] - values[i] if i + 1 < len(values) else 0
            j = i + 1
            while j < len(values) and values[j] - values[j - 1] == step:
                j += 1
            first, count, i = values[i], j - i, j
            if runs and runs[-1][1:3] == (step, count) and (runs[-1][3] == 1 or first == runs[-1][0] + runs[-1][4] * runs[-1][3]):
                last = runs[-1]  # the same run again, moved: one more time of it
                runs[-1] = (last[0], step, count, last[3] + 1, first - last[0] if last[3] == 1 else last[4])
            else:
                runs.append((first, step, count, 1, 0))
        return cls(runs)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: int) -> int:
        r = bisect.bisect_right(self._ends, i)
        first, step, count, _, shift = self.runs[r]
        time, k = divmod(i - (self._ends[r - 1] if r else 0), count)
        return first + shift * time + step * k

    def __iter__(self) -> Iterator[int]:
        for first, step, count, times, shift in self.runs:
            for start in range(first, first + shift * times, shift) if shift else itertools.repeat(first, times):
                yield from range(start, start + step * count, step) if step else itertools.repeat(start, count)

    def count_at_most(self, value: int) -> int:
        """How many elements are <= ``value`` (the sequence strictly increasing)."""
        return bisect.bisect_right(range(len(self)), value, key=self.__getitem__)

    def positions(self, value: int) -> list[range]:
        """The indices holding ``value``, as ranges (a replicated tensor's N holders are one)."""
        found: list[range] = []
        for (first, step, count, times, shift), end in zip(self.runs, self._ends):
            start = end - count * times
            if not step and not shift:
                found.extend([range(start, end)] if first == value else [])
            elif not step or not shift:  # one of the two moves: solve for it
                k, rest = divmod(value - first, step or shift)
                if not rest and 0 <= k < (count if step else times):
                    found.append(range(start + k, end, count) if step else range(start + k * count, start + (k + 1) * count))
            else:  # both move: solve for one per value of the other (the fewer: TP's 8)
                for a in range(min(times, count)):
                    if times <= count:
                        time, (k, rest) = a, divmod(value - first - shift * a, step)
                    else:
                        k, (time, rest) = a, divmod(value - first - step * a, shift)
                    if not rest and 0 <= k < count and 0 <= time < times:
                        found.append(range(start + time * count + k, start + time * count + k + 1))
        return found

    def holder(self, value: int, rank: int) -> int | None:
        """The index holding ``value`` that ``rank`` reads: its own when it holds it, else one
        spread by ``rank`` (8 new ranks read a replicated tensor from 8 old ones); None: none."""
        if rank < len(self) and self[rank] == value:
            return rank
        found = self.positions(value)
        n = rank % max(1, sum(len(r) for r in found))
        for ranks in found:
            if n < len(ranks):
                return ranks[n]
            n -= len(ranks)
        return None

    def bounds(self) -> tuple[int, int]:
        """The least and greatest values (each run's are at its corners)."""
        corners = [first + step * k + shift * t for first, step, count, times, shift in self.runs
                   for k in (0, count - 1) for t in (0, times - 1)]
        return min(corners), max(corners)

    def rising(self) -> bool:
        return all((step > 0 or count == 1) and (times == 1 or shift > step * (count - 1))
                   for _, step, count, times, shift in self.runs) and \
            all(self[end - 1] < self[end] for end in self._ends[:-1])

    def flat(self) -> list[int]:
        return [n for run in self.runs for n in run]

    @classmethod
    def from_flat(cls, raw: object, what: str, width: int = 5) -> Progression:
        """From its JSON (``[first, step, count, times, shift, ...]``; a version 1 layout's runs
        are ``[first, step, count]``), every value checked in bounds."""
        if not isinstance(raw, list) or len(raw) % width or not all(type(n) is int and abs(n) < _MAX_INT for n in raw):
            raise ValueError(f"{what} must be a flat list of runs of {width} integers")
        runs = [(*raw[i : i + 3], *(raw[i + 3 : i + 5] or (1, 0))) for i in range(0, len(raw), width)]
        for run in runs:
            if min(run[2:4]) < 1 or abs(run[1] * run[2]) + abs(run[3] * run[4]) >= _MAX_INT:
                raise ValueError(f"{what} has a run {list(run)} out of bounds")
        values = cls(runs)  # type: ignore[arg-type]
        if values.runs and values.bounds()[0] < _ABSENT:
            raise ValueError(f"{what} has a run out of bounds")
        return values


@dataclasses.dataclass(frozen=True)
class _Grid:
    """A DTensor tiled as a grid: per dimension the starts of its intervals; per old rank the
    cell (row-major over the intervals) it holds, or -1."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    starts: tuple[Progression, ...]
    owners: Progression

    def sample(self) -> tuple[int, TensorRecord]:
        rank = next(r for r, cell in enumerate(self.owners) if cell != _ABSENT)
        return rank, self.cell_record(self.owners[rank])

    def cell_box(self, cell: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offset, shape = [], []
        for starts, size in zip(reversed(self.starts), reversed(self.global_shape)):
            cell, i = divmod(cell, len(starts))
            start = starts[i]
            offset.append(start)
            shape.append((starts[i + 1] if i + 1 < len(starts) else size) - start)
        return tuple(reversed(offset)), tuple(reversed(shape))

    def cell_record(self, cell: int) -> TensorRecord:
        offset, shape = self.cell_box(cell)
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[self.dtype]
        return TensorRecord(self.name, self.dtype, shape, nbytes, (0, nbytes), 0,
                            global_shape=self.global_shape, global_offset=offset)

    def plan(self, target: TargetTensor, target_rank: int, same_world: bool) -> list[Piece]:
        if (target.dtype, target.global_shape) != (self.dtype, self.global_shape):
            return plan_tensor(target, [self.sample()])  # raises, saying what differs
        _check_box(target.name, "the restoring rank", target.global_shape, target.global_offset, target.shape)
        if math.prod(target.shape) == 0:
            return []
        assert target.global_offset is not None
        target_box = (target.global_offset, target.shape)
        ranges = [range(s.count_at_most(lo) - 1, s.count_at_most(lo + n - 1))
                  for s, lo, n in zip(self.starts, target.global_offset, target.shape)]
        strides = _strides(tuple(len(s) for s in self.starts))  # of the cells, row-major
        pieces = []
        for coords in itertools.product(*ranges):
            cell = sum(i * stride for i, stride in zip(coords, strides))
            rank = self.owners.holder(cell, target_rank)
            if rank is None:
                raise SnapshotLayoutMismatch(f"tensor {self.name}: no old rank holds its shard at {self.cell_box(cell)[0]}; "
                                             "check that the snapshot holds every old rank")
            record = self.cell_record(cell)
            source_box = (record.global_offset, record.shape)
            common = _intersect(source_box, target_box)  # type: ignore[arg-type]
            if common is not None:
                pieces.append(Piece(rank, record, _runs(common, source_box, target_box,  # type: ignore[arg-type]
                                                        DTYPE_ITEMSIZE[self.dtype])))
        return sorted(pieces, key=lambda piece: piece.source_rank)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "global_shape": list(self.global_shape),
                "starts": [s.flat() for s in self.starts], "owners": self.owners.flat()}

    @classmethod
    def from_json(cls, raw: dict, world_size: int) -> _Grid:
        name, dtype = raw["name"], raw["dtype"]
        global_shape = _shape(raw.get("global_shape"), f"global_shape of {name}")
        starts_raw = raw.get("starts")
        if not isinstance(starts_raw, list) or len(starts_raw) != len(global_shape):
            raise ValueError(f"starts of {name} must be one list per dimension")
        starts = tuple(Progression.from_flat(s, f"starts of {name}") for s in starts_raw)
        for d, (s, size) in enumerate(zip(starts, global_shape)):
            if not s.rising() or s[0] != 0 or s[len(s) - 1] >= size:
                raise ValueError(f"starts of {name} along dimension {d} must rise from 0 inside {size}")
        cells = math.prod(len(s) for s in starts)
        if cells > world_size:  # each cell is some rank's shard
            raise ValueError(f"{name} is cut in {cells} shards, more than the {world_size} ranks")
        owners = _per_rank(raw, "owners", world_size, cells, f"a cell of {cells}")
        return cls(name, dtype, global_shape, starts, owners)


@dataclasses.dataclass(frozen=True)
class _Plain:
    """A plain tensor of one dtype and shape: per old rank its bytes' crc32, or -1."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    crcs: Progression

    def record(self, rank: int) -> TensorRecord:
        nbytes = math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]
        return TensorRecord(self.name, self.dtype, self.shape, nbytes, (0, nbytes), self.crcs[rank])

    def held(self) -> set[int]:
        """The crc32s old ranks hold (two at most: enough to say they differ), from the runs: a
        3 x 3 corner of a run holds two of its values when it holds two (a line holds one -1)."""
        found: set[int] = set()
        for first, step, count, times, shift in self.crcs.runs:
            found.update(first + step * k + shift * t for k in range(min(count, 3)) for t in range(min(times, 3)))
            found.discard(_ABSENT)
            if len(found) > 1:
                break
        return found

    def plan(self, target: TargetTensor, target_rank: int, same_world: bool) -> list[Piece]:
        """One piece from one holder, chosen in O(runs) (N equal copies are one run), then
        checked against the target by :func:`plan_tensor`."""
        own = target_rank < len(self.crcs) and self.crcs[target_rank] != _ABSENT
        held = self.held()
        if len(held) > 1 and not (same_world and own):  # plan_tensor says which two differ
            first = next(r for r, crc in enumerate(self.crcs) if crc != _ABSENT)
            other = next(r for r, crc in enumerate(self.crcs) if crc not in (_ABSENT, self.crcs[first]))
            return plan_tensor(target, [(r, self.record(r)) for r in (first, other)], target_rank=target_rank,
                               same_world=same_world)
        chosen = target_rank if own else self.crcs.holder(held.pop(), target_rank)
        return plan_tensor(target, [(chosen, self.record(chosen))])  # type: ignore[list-item]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "crc32s": self.crcs.flat()}

    @classmethod
    def from_json(cls, raw: dict, world_size: int) -> _Plain:
        name = raw["name"]
        crcs = _per_rank(raw, "crc32s", world_size, 1 << 32, "a crc32")
        return cls(name, raw["dtype"], _shape(raw.get("shape"), f"shape of {name}"), crcs)


@dataclasses.dataclass(frozen=True)
class _Records:
    """Shards that are not a grid, or records that disagree: kept whole, checked when planned."""

    name: str
    records: tuple[tuple[int, TensorRecord], ...]

    def plan(self, target: TargetTensor, target_rank: int, same_world: bool) -> list[Piece]:
        return plan_tensor(target, self.records, target_rank=target_rank, same_world=same_world)

    def to_json(self) -> dict:
        return {"name": self.name, "records": [[rank, record.to_json()] for rank, record in self.records]}

    @classmethod
    def from_json(cls, raw: dict, world_size: int) -> _Records:
        name, entries = raw["name"], raw.get("records")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"records of {name} must be a non-empty list")
        records = []
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int \
                    or not 0 <= entry[0] < world_size:
                raise ValueError(f"records of {name} must be [rank, record] pairs of ranks below {world_size}")
            record = TensorRecord.from_json(entry[1])
            if record.name != name:
                raise ValueError(f"a record of {name} names {record.name}")
            records.append((entry[0], record))
        return cls(name, tuple(sorted(records, key=lambda pair: pair[0])))


_Layout = _Grid | _Plain | _Records
_KINDS: dict[str, type] = {"starts": _Grid, "crc32s": _Plain, "records": _Records}


class LayoutIndex:
    """Every old rank's shards of one snapshot, by tensor."""

    def __init__(self, manifests: Mapping[int, Sequence[TensorRecord]], world_size: int | None = None):
        if not manifests:
            raise SnapshotLayoutMismatch("the snapshot has no ranks to restore from")
        self.world_size = world_size if world_size is not None else max(manifests) + 1
        holders: dict[str, list[tuple[int, TensorRecord]]] = {}
        for rank in sorted(manifests):
            for record in manifests[rank]:
                held = holders.setdefault(record.name, [])
                if held and held[-1][0] == rank:  # ranks come in order: a name held twice by one is its last
                    raise SnapshotLayoutMismatch(f"tensor {record.name} appears twice in the manifest of old rank {rank}")
                held.append((rank, record))
        self._tensors: dict[str, _Layout] = {name: _layout_of(name, pairs, self.world_size)
                                             for name, pairs in holders.items()}

    @classmethod
    def merged(cls, parts: Sequence[tuple[Sequence, Sequence[str], Sequence[int]]], world_size: int) -> LayoutIndex:
        """The index of every host's :func:`layout_part` (``(kinds, names, kind_of)``, any order),
        in time linear in the parts: a tensor's records at each host are a kind, and tensors of
        the same kind at every host are laid out once. ValueError when the parts are not valid."""
        try:
            columns = {id(names): dict(zip(names, kind_of, strict=True)) for _, names, kind_of in parts}
            classes: dict[tuple, list[str]] = {}
            for name in sorted({name for column in columns.values() for name in column}):
                classes.setdefault(tuple(column.get(name, -1) for column in columns.values()), []).append(name)
            index = object.__new__(cls)
            index.world_size, index._tensors = world_size, {}
            for names in classes.values():
                entries = sorted((entry for kinds, part_names, _ in parts
                                  if (k := columns[id(part_names)].get(names[0])) is not None for entry in kinds[k]),
                                 key=lambda entry: entry[0])
                ranks = [entry[0] for entry in entries]
                if not 0 <= ranks[0] <= ranks[-1] < world_size or len(set(ranks)) != len(ranks):
                    raise ValueError(f"{names[0]} is held twice by a rank or by a rank out of 0..{world_size - 1}")
                first = None
                for name in names:  # one layout per kind: the others are it renamed (records: each its own)
                    if first is None or isinstance(first, _Records):
                        first = _layout_of(name, [(e[0], TensorRecord(name, e[1], _shape(e[2], name), e[3], (0, e[3]), e[4], None, None, *(
                            None if box is None else _shape(box, name) for box in e[5:7]))) for e in entries], world_size)
                    index._tensors[name] = first if first.name == name else dataclasses.replace(first, name=name)
        except (KeyError, TypeError, IndexError, ValueError, SnapshotLayoutMismatch) as exc:
            raise ValueError(f"the hosts' parts of the layout index do not merge: {exc!r}") from None
        if not index._tensors:
            raise ValueError("the hosts' parts hold no tensor")
        return index

    @classmethod
    def from_bytes(cls, raw: bytes, world_size: int) -> LayoutIndex:
        """``layout.json`` of a snapshot of ``world_size`` ranks; ValueError when it is not one."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT or doc.get("version") not in (1, LAYOUT_VERSION):
            raise ValueError(f"not a {LAYOUT_FORMAT} of version 1 or {LAYOUT_VERSION}")
        if doc.get("world_size") != world_size or not isinstance(doc.get("tensors"), list):
            raise ValueError(f"not the layout of {world_size} ranks")
        index = object.__new__(cls)
        index.world_size, index._tensors = world_size, {}
        for entry in doc["tensors"]:
            kind = next((_KINDS[key] for key in _KINDS if isinstance(entry, dict) and key in entry), None)
            if kind is None or not isinstance(entry.get("name"), str) or entry["name"] in index._tensors:
                raise ValueError("each tensor must be a grid, a plain tensor or records, named once")
            if kind is not _Records and (not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPE_ITEMSIZE):
                raise ValueError(f"dtype of {entry['name']} is not supported")
            try:
                index._tensors[entry["name"]] = kind.from_json(_widened(entry) if doc["version"] == 1 else entry, world_size)
            except (KeyError, TypeError, IndexError) as exc:  # a shape the checks above did not foresee
                raise ValueError(f"tensor {entry['name']} is malformed: {exc!r}") from None
        return index

    def to_bytes(self) -> bytes:
        """``layout.json``: the same bytes from the same manifests, whichever host writes it."""
        doc = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "world_size": self.world_size,
               "tensors": [self._tensors[name].to_json() for name in sorted(self._tensors)]}
        return json.dumps(doc, separators=(",", ":")).encode()

    def promoted(self, targets: Sequence[TargetTensor]) -> tuple[list[TargetTensor], LayoutIndex]:
        """A plain tensor and a DTensor of the same global shape are the same tensor, whole (FSDP at one world size,
        none at another): a plain target over a grid of its shape becomes the whole box; plain old tensors of a DTensor
        target's global shape become whole boxes only when every old rank holds the same bytes (crc32)."""
        out, promoted = [], {}
        for target in targets:
            found = self._tensors.get(target.name)
            if target.global_shape is None and isinstance(found, _Grid) and found.global_shape == target.shape:
                target = dataclasses.replace(target, global_shape=target.shape, global_offset=(0,) * len(target.shape))
            elif target.global_shape is not None and isinstance(found, _Plain) and len(found.held()) == 1 \
                    and found.shape == tuple(target.global_shape) and all(found.shape):
                owners = Progression([cut for run in found.crcs.runs for cut in (  # held: cell 0; a run of one value stays one
                    [(_ABSENT if run[0] == _ABSENT else 0, 0, *run[2:4], 0)] if run[1] == run[4] == 0 else
                    Progression.of([_ABSENT if crc == _ABSENT else 0 for crc in Progression([run])]).runs)])
                starts = tuple(Progression([(0, 0, 1, 1, 0)]) for _ in found.shape)
                promoted[target.name] = _Grid(found.name, found.dtype, found.shape, starts, owners)
            out.append(target)
        if not promoted:
            return out, self
        copy = object.__new__(LayoutIndex)
        copy.world_size, copy._tensors = self.world_size, {**self._tensors, **promoted}
        return out, copy

    def plan(self, targets: Sequence[TargetTensor], *, target_rank: int, same_world: bool) -> dict[str, list[Piece]]:
        """Every target tensor's pieces (by name), their sources box records until :func:`bind`.
        ``same_world``: a plain tensor differing between ranks is each rank's own."""
        names: set[str] = set()
        for target in targets:
            if target.name in names:
                raise SnapshotLayoutMismatch(f"tensor {target.name} appears twice in the restoring rank's segment")
            names.add(target.name)
        if missing := sorted(names - self._tensors.keys()):
            raise SnapshotLayoutMismatch(f"tensor {missing[0]} is in no rank of the snapshot "
                                         f"({len(missing)} such in all); restore into a job with the same "
                                         "model and optimizer state as the snapshot's")
        return {t.name: self._tensors[t.name].plan(t, target_rank, same_world) for t in targets}


def layout_part(manifests: Mapping[int, Sequence[TensorRecord]]) -> tuple[list, list[str], list[int]]:
    """One host's ranks' part of the layout index (what :meth:`LayoutIndex.merged` merges): ``(kinds, names, kind_of)``:
    each distinct list of per-rank entries ``[rank, dtype, shape, nbytes, crc32, global_shape, global_offset]`` (a
    DTensor's crc32 left out: its box is its identity), and per tensor name (sorted) the kind it is. Tensors cut alike
    are one kind, so the part is small and ``names, kind_of`` are the same on every host of the same tensors."""
    holders: dict[str, list] = {}
    for rank in sorted(manifests):
        for r in manifests[rank]:
            entry = [rank, r.dtype, list(r.shape), r.nbytes, 0 if r.global_shape is not None else r.crc32,
                     None if r.global_shape is None else list(r.global_shape),
                     None if r.global_offset is None else list(r.global_offset)]
            held = holders.setdefault(r.name, [])
            if held and held[-1][0] == rank:
                raise SnapshotLayoutMismatch(f"tensor {r.name} appears twice in the manifest of old rank {rank}")
            held.append(entry)
    kinds: dict[str, int] = {}
    names = sorted(holders)
    kind_of = [kinds.setdefault(json.dumps(holders[name]), len(kinds)) for name in names]
    return [json.loads(raw) for raw in kinds], names, kind_of


def _layout_of(name: str, pairs: list[tuple[int, TensorRecord]], world_size: int) -> _Layout:
    """The most compact exact form of one tensor's records."""
    first = pairs[0][1]
    itemsize = DTYPE_ITEMSIZE.get(first.dtype)
    uniform = itemsize is not None and all(
        (r.dtype, r.global_shape) == (first.dtype, first.global_shape) and r.nbytes == math.prod(r.shape) * itemsize
        and (r.global_shape is not None or r.shape == first.shape) for _, r in pairs)
    if uniform and first.global_shape is None:
        crcs = [_ABSENT] * world_size
        for rank, record in pairs:
            crcs[rank] = record.crc32
        return _Plain(name, first.dtype, first.shape, Progression.of(crcs))
    grid = _grid_of(name, pairs, world_size) if uniform else None
    return grid if grid is not None else _Records(name, tuple(pairs))


def _grid_of(name: str, pairs: list[tuple[int, TensorRecord]], world_size: int) -> _Grid | None:
    first = pairs[0][1]
    global_shape = tuple(first.global_shape)  # type: ignore[arg-type]
    boxes: dict[tuple, list[int]] = {}
    for rank, record in pairs:
        try:
            _check_box(name, f"old rank {rank}", global_shape, record.global_offset, record.shape)
        except SnapshotLayoutMismatch:
            return None
        if math.prod(record.shape):
            boxes.setdefault((tuple(record.global_offset), tuple(record.shape)), []).append(rank)  # type: ignore[arg-type]
    if not boxes:
        return None
    starts: list[list[int]] = []
    for d, size in enumerate(global_shape):
        intervals = sorted({(offset[d], shape[d]) for offset, shape in boxes})
        cuts = list(itertools.accumulate((length for _, length in intervals), initial=0))
        if [start for start, _ in intervals] != cuts[:-1] or cuts[-1] != size:
            return None  # a gap or an overlap along this dimension, or short of its end
        starts.append(cuts[:-1])
    if len(boxes) != math.prod(len(s) for s in starts):
        return None  # not every combination of intervals is a shard
    where = [{start: i for i, start in enumerate(s)} for s in starts]
    owners, strides = [_ABSENT] * world_size, _strides(tuple(len(s) for s in starts))
    for (offset, _), ranks in boxes.items():
        cell = sum(where[d][start] * stride for d, (start, stride) in enumerate(zip(offset, strides)))
        for rank in ranks:
            owners[rank] = cell
    return _Grid(name, first.dtype, global_shape, tuple(Progression.of(s) for s in starts), Progression.of(owners))


def bind(plan: Mapping[str, list[Piece]], records: Mapping[int, Sequence[TensorRecord]]) -> dict[str, list[Piece]]:
    """The plan with each piece's source the record its old rank's manifest holds (``records``),
    which must describe the same shard as the layout index."""
    by_rank = {rank: {t.name: t for t in tensors} for rank, tensors in records.items()}
    bound: dict[str, list[Piece]] = {}
    for name, pieces in plan.items():
        bound[name] = []
        for piece in pieces:
            real, box = by_rank[piece.source_rank].get(name), piece.source
            if real is None or not _same_shard(real, box):
                raise SnapshotCorruptError(
                    f"the layout index of the snapshot says old rank {piece.source_rank} holds tensor {name} "
                    f"as {box.dtype}{list(box.shape)} at {box.global_offset}, its manifest says "
                    f"{'nothing' if real is None else f'{real.dtype}{list(real.shape)} at {real.global_offset}'}")
            bound[name].append(dataclasses.replace(piece, source=real))
    return bound


def _same_shard(real: TensorRecord, box: TensorRecord) -> bool:
    if (real.dtype, tuple(real.shape), real.nbytes) != (box.dtype, tuple(box.shape), box.nbytes):
        return False
    if real.global_shape is None and box.global_shape is not None:  # a plain replica taken whole
        return tuple(box.global_shape) == tuple(box.shape) and not any(box.global_offset or ())
    if real.global_shape is None:
        return box.crc32 == real.crc32
    return (tuple(real.global_shape), tuple(real.global_offset or ())) == \
        (tuple(box.global_shape or ()), tuple(box.global_offset or ()))


def _per_rank(raw: dict, key: str, world_size: int, bound: int, each: str) -> Progression:
    """``raw[key]``: per old rank a value below ``bound`` or -1, not all -1 (some rank holds it)."""
    what = f"{key} of {raw['name']}"
    values = Progression.from_flat(raw.get(key), what)
    if len(values) != world_size or values.bounds()[1] >= bound:
        raise ValueError(f"{what} must give each of {world_size} ranks {each} or -1")
    if values.bounds() == (_ABSENT, _ABSENT):
        raise ValueError(f"no rank holds {raw['name']}")
    return values


def _widened(entry: dict) -> dict:
    """A version 1 entry's runs ``[first, step, count]`` as version 2's, moved 0 times over."""
    def widen(runs):
        return [n for i in range(0, len(runs), 3) for n in (*runs[i:i + 3], 1, 0)] if isinstance(runs, list) and len(runs) % 3 == 0 else runs
    return {key: [widen(s) for s in value] if key == "starts" and isinstance(value, list) else
            widen(value) if key in ("owners", "crc32s") else value for key, value in entry.items()}


def _shape(raw: object, what: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(type(n) is int and 0 <= n < _MAX_INT for n in raw):
        raise ValueError(f"{what} must be a list of sizes")
    return tuple(raw)
