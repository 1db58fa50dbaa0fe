"""The reshard planner against a brute-force reference: old shards cut from a global tensor of
distinct elements, the plan's runs applied into each new rank's buffer, compared with the new
rank's box cut directly from the global tensor. Pure Python, no torch, no processes."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from swap_state.common.dtypes import DTYPE_ITEMSIZE
from swap_state.common.snapshot_errors import SnapshotLayoutMismatch
from swap_state.common.snapshot_format import TensorRecord
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, bind
from swap_state.server.snapshot.restoring.reshard import Piece, Run, TargetTensor, plan_tensor, ranks_needed

S0, S1, R = ("S", 0), ("S", 1), ("R",)


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's split of n into parts (start, length): ceil-sized, trailing ones may be
    short or empty, as DTensor's Shard does."""
    size = -(-n // parts) if parts else 0
    return [(min(i * size, n), max(0, min(size, n - i * size))) for i in range(parts)]


def _layout(global_shape, mesh, placements):
    """Per rank (mesh row-major) the box (offset, shape) it holds."""
    boxes = []
    for coord in itertools.product(*(range(m) for m in mesh)):
        offset, shape = [0] * len(global_shape), list(global_shape)
        for mesh_dim, placement in enumerate(placements):
            if placement[0] == "S":
                d = placement[1]
                start, length = _chunks(shape[d], mesh[mesh_dim])[coord[mesh_dim]]
                offset[d] += start
                shape[d] = length
        boxes.append((tuple(offset), tuple(shape)))
    return boxes


def _element(i: int, itemsize: int) -> bytes:
    # An odd multiplier is a bijection modulo 2**bits: every element's bytes are distinct.
    return ((i + 1) * 0x9E3779B1 % (1 << (8 * itemsize))).to_bytes(itemsize, "little")


def _global_bytes(global_shape, itemsize: int) -> bytes:
    return b"".join(_element(i, itemsize) for i in range(math.prod(global_shape)))


def _cut(data: bytes, global_shape, box, itemsize: int) -> bytes:
    offset, shape = box
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    out = bytearray()
    for index in itertools.product(*(range(o, o + s) for o, s in zip(offset, shape))):
        flat = sum(i * st for i, st in zip(index, strides))
        out += data[flat * itemsize:(flat + 1) * itemsize]
    return bytes(out)


def _record(name, dtype, box, global_shape, crc=0) -> TensorRecord:
    nbytes = math.prod(box[1]) * DTYPE_ITEMSIZE[dtype]
    return TensorRecord(
        name=name, dtype=dtype, shape=box[1], nbytes=nbytes, data_offsets=(0, nbytes),
        crc32=crc, global_shape=global_shape, global_offset=box[0],
    )


def _target(name, dtype, box, global_shape) -> TargetTensor:
    return TargetTensor(name, dtype, box[1], global_shape, box[0])


def _apply(pieces: list[Piece], shards: dict[int, bytes], nbytes: int) -> bytes:
    out = bytearray(nbytes)
    for piece in pieces:
        src = shards[piece.source_rank]
        targets = [run.target_offset for run in piece.runs]
        assert targets == sorted(targets)
        for run in piece.runs:
            assert run.source_offset + run.nbytes <= piece.source.nbytes
            out[run.target_offset:run.target_offset + run.nbytes] = (
                src[run.source_offset:run.source_offset + run.nbytes]
            )
    return bytes(out)


def _reshard(global_shape, old, new, dtype="float32"):
    """Plans every new rank of layout ``new`` from layout ``old`` and checks its bytes, both
    per tensor (:func:`plan_tensor`) and through the index (:class:`LayoutIndex`, the new
    rank's number as its rank). Returns the per-tensor plans, per new rank."""
    itemsize = DTYPE_ITEMSIZE[dtype]
    data = _global_bytes(global_shape, itemsize)
    shards = {rank: _cut(data, global_shape, box, itemsize) for rank, box in enumerate(old)}
    sources = [(rank, _record("w", dtype, box, global_shape)) for rank, box in enumerate(old)]
    index = LayoutIndex({rank: [record] for rank, record in sources})
    stored = LayoutIndex.from_bytes(index.to_bytes(), len(old))  # as layout.json is read back
    plans = []
    for new_rank, box in enumerate(new):
        target = _target("w", dtype, box, global_shape)
        pieces = plan_tensor(target, sources[::-1])
        indexed = index.plan([target], target_rank=new_rank, same_world=False)["w"]
        assert stored.plan([target], target_rank=new_rank, same_world=False)["w"] == indexed
        want = _cut(data, global_shape, box, itemsize)
        assert _apply(pieces, shards, len(want)) == want
        assert _apply(indexed, shards, len(want)) == want
        assert sorted(r.nbytes for p in indexed for r in p.runs) == sorted(r.nbytes for p in pieces for r in p.runs)
        plans.append(pieces)
    return plans


CASES = {
    "shard0 4->2": ((8, 6), ((4,), (S0,)), ((2,), (S0,))),
    "shard0 4->3 uneven": ((10, 3), ((4,), (S0,)), ((3,), (S0,))),
    "shard0 2->5 uneven": ((7, 2, 3), ((2,), (S0,)), ((5,), (S0,))),
    "shard1 2->3": ((5, 7), ((2,), (S1,)), ((3,), (S1,))),
    "shard0 -> shard1": ((6, 5), ((3,), (S0,)), ((2,), (S1,))),
    "mesh s0xs1 4->2": ((6, 8), ((2, 2), (S0, S1)), ((2,), (S0,))),
    "mesh s1xs0 4->3x2": ((7, 9), ((2, 2), (S1, S0)), ((3, 2), (S0, S1))),
    "replicate 4->2": ((6, 4), ((4,), (R,)), ((2,), (S0,))),
    "replicate x shard0 4->3": ((6, 4), ((2, 2), (R, S0)), ((3,), (S1,))),
    "shard0 x replicate 4->1": ((5, 3), ((2, 2), (S0, R)), ((1,), (R,))),
    "3-d shard2 3->2": ((2, 3, 7), ((3,), (("S", 2),)), ((2,), (S1,))),
    "empty shards 4->3": ((2, 3), ((4,), (S0,)), ((3,), (S0,))),
    "0-dim 2->3": ((), ((2,), (R,)), ((3,), (R,))),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_the_brute_force_reference(case, dtype):
    global_shape, (old_mesh, old_pl), (new_mesh, new_pl) = CASES[case]
    if dtype == "uint8" and math.prod(global_shape) > 255:
        pytest.skip("uint8 elements would not all be distinct")
    _reshard(global_shape, _layout(global_shape, old_mesh, old_pl),
             _layout(global_shape, new_mesh, new_pl), dtype)


def test_shard0_pieces_are_one_run_each():
    plans = _reshard((8, 6), _layout((8, 6), (4,), (S0,)), _layout((8, 6), (2,), (S0,)))
    assert [[p.source_rank for p in pieces] for pieces in plans] == [[0, 1], [2, 3]]
    assert plans[1][0].runs == (Run(0, 0, 2 * 6 * 4),)
    assert plans[1][1].runs == (Run(0, 2 * 6 * 4, 2 * 6 * 4),)


def test_uneven_shard0_4_to_3():
    old, new = _layout((10, 3), (4,), (S0,)), _layout((10, 3), (3,), (S0,))
    assert [box[1][0] for box in old] == [3, 3, 3, 1]
    assert [box[1][0] for box in new] == [4, 4, 2]
    plans = _reshard((10, 3), old, new)
    assert [[p.source_rank for p in pieces] for pieces in plans] == [[0, 1], [1, 2], [2, 3]]


def test_shard1_runs_are_one_per_row():
    plans = _reshard((5, 7), _layout((5, 7), (2,), (S1,)), _layout((5, 7), (3,), (S1,)))
    # New rank 1 holds columns 3..5: column 3 from old rank 0, columns 4..5 from old rank 1.
    assert [p.source_rank for p in plans[1]] == [0, 1]
    assert all(len(p.runs) == 5 for p in plans[1])


def test_replicas_are_read_once_from_the_lowest_rank():
    plans = _reshard((6, 4), _layout((6, 4), (4,), (R,)), _layout((6, 4), (2,), (S0,)))
    assert [[p.source_rank for p in pieces] for pieces in plans] == [[0], [0]]
    mixed = _reshard((6, 4), _layout((6, 4), (2, 2), (R, S0)), _layout((6, 4), (3,), (S1,)))
    assert {p.source_rank for pieces in mixed for p in pieces} == {0, 1}


def test_empty_and_zero_dim():
    plans = _reshard((2, 3), _layout((2, 3), (4,), (S0,)), _layout((2, 3), (3,), (S0,)))
    assert [[p.source_rank for p in pieces] for pieces in plans] == [[0], [1], []]
    plans = _reshard((), [((), ())] * 2, [((), ())], "bfloat16")
    assert plans == [[Piece(0, _record("w", "bfloat16", ((), ()), ()), (Run(0, 0, 2),))]]


def test_large_shard0_and_shard1_plans():
    shape = (14336, 4096)
    rows = [(rank, _record("w", "bfloat16", box, shape))
            for rank, box in enumerate(_layout(shape, (4,), (S0,)))]
    full = _target("w", "bfloat16", ((0, 0), shape), shape)
    assert [len(p.runs) for p in plan_tensor(full, rows)] == [1, 1, 1, 1]
    cols = [(rank, _record("w", "bfloat16", box, shape))
            for rank, box in enumerate(_layout(shape, (2,), (S1,)))]
    assert [len(p.runs) for p in plan_tensor(full, cols)] == [14336, 14336]
    new = _target("w", "bfloat16", _layout(shape, (3,), (S1,))[1], shape)
    pieces = plan_tensor(new, cols)
    assert [len(p.runs) for p in pieces] == [14336, 14336]
    assert sum(r.nbytes for p in pieces for r in p.runs) == 14336 * 1366 * 2


def _plain(rank: int, crc: int) -> tuple[int, TensorRecord]:
    return rank, TensorRecord("step", "int64", (3,), 24, (0, 24), crc)


PLAIN = TargetTensor("step", "int64", (3,), None, None)


def test_plain_equal_crcs_take_the_lowest_rank():
    pieces = plan_tensor(PLAIN, [_plain(2, 7), _plain(0, 7), _plain(1, 7)])
    assert [(p.source_rank, p.runs) for p in pieces] == [(0, (Run(0, 0, 24),))]


def test_plain_differing_crcs_same_world_take_own_rank():
    pieces = plan_tensor(PLAIN, [_plain(0, 7), _plain(1, 8)], target_rank=1, same_world=True)
    assert [(p.source_rank, p.runs) for p in pieces] == [(1, (Run(0, 0, 24),))]


@pytest.mark.parametrize("same_world", [False, True])
def test_plain_differing_crcs_cannot_be_resharded(same_world):
    with pytest.raises(SnapshotLayoutMismatch, match=r"step is a plain .* \(0 and 1\)"):
        plan_tensor(PLAIN, [_plain(0, 7), _plain(1, 8)], target_rank=4, same_world=same_world)


GLOBAL = (4, 2)
EMB = "emb.weight"
HALVES = [(0, _record(EMB, "float32", ((0, 0), (2, 2)), GLOBAL)),
          (1, _record(EMB, "float32", ((2, 0), (2, 2)), GLOBAL))]
WHOLE = _target(EMB, "float32", ((0, 0), GLOBAL), GLOBAL)
PLAIN_EMB = (0, TensorRecord(EMB, "float32", GLOBAL, 32, (0, 32), 0))


@pytest.mark.parametrize(
    ("target", "sources", "message"),
    [
        (_target(EMB, "bfloat16", ((0, 0), GLOBAL), GLOBAL), HALVES, "saved it as float32"),
        (_target(EMB, "float32", ((0, 0), (4, 2)), (4, 3)), HALVES, "global shape"),
        (WHOLE, HALVES[:1], "not covered"),
        (WHOLE, HALVES + [(2, _record(EMB, "float32", ((1, 0), (2, 2)), GLOBAL))],
         "overlapping shards of old ranks 0 and 2"),
        (WHOLE, [PLAIN_EMB], "saved it as a plain tensor"),
        (TargetTensor(EMB, "float32", GLOBAL, None, None), HALVES, "saved it as a DTensor"),
        (TargetTensor(EMB, "float32", GLOBAL, GLOBAL, None), HALVES, "do not describe a box"),
        (TargetTensor(EMB, "float32", GLOBAL, GLOBAL, (0,)), HALVES, "do not describe a box"),
        (PLAIN, [(0, TensorRecord("step", "int64", (4,), 32, (0, 32), 0))], "shape"),
        (WHOLE, [], "no rank"),
    ],
)
def test_mismatches(target, sources, message):
    with pytest.raises(SnapshotLayoutMismatch, match=message) as caught:
        plan_tensor(target, sources)
    assert target.name in str(caught.value)


def plan_rank(targets, manifests, *, target_rank: int, same_world: bool) -> dict[str, list[Piece]]:
    """One new rank's plan from every old rank's records (an index built for it, then bound)."""
    return bind(LayoutIndex(manifests).plan(targets, target_rank=target_rank, same_world=same_world), manifests)


def test_plan_rank_and_ranks_needed():
    manifests = {
        0: [HALVES[0][1], _plain(0, 5)[1]],
        1: [_plain(1, 5)[1], HALVES[1][1]],
    }
    lower = _target(EMB, "float32", ((0, 0), (3, 2)), GLOBAL)
    plan = plan_rank([lower, PLAIN], manifests, target_rank=0, same_world=False)
    assert [p.source_rank for p in plan[EMB]] == [0, 1]
    assert [p.source_rank for p in plan["step"]] == [0]
    assert ranks_needed(plan) == [0, 1]
    upper = _target(EMB, "float32", ((3, 0), (1, 2)), GLOBAL)
    plan = plan_rank([upper, PLAIN], manifests, target_rank=1, same_world=False)
    assert ranks_needed(plan) == [1]  # the plain step's bytes from its own old rank's file
    assert ranks_needed(plan_rank([upper], {1: [HALVES[1][1]]}, target_rank=0,
                                  same_world=False)) == [1]


def test_plan_rank_takes_each_tensor_from_the_old_ranks_that_hold_it():
    """Pipeline stages hold disjoint tensors: rank 0 a plain ``step`` and half the embedding,
    rank 1 the other half. A restoring rank with both takes each from where it is; one
    without ``step`` leaves it to another new rank; a tensor in no old rank is refused."""
    manifests = {0: [HALVES[0][1], _plain(0, 5)[1]], 1: [HALVES[1][1]]}
    plan = plan_rank([WHOLE, PLAIN], manifests, target_rank=0, same_world=False)
    assert [piece.source_rank for piece in plan[WHOLE.name]] == [0, 1]
    assert [piece.source_rank for piece in plan["step"]] == [0]
    assert list(plan_rank([WHOLE], manifests, target_rank=0, same_world=False)) == [WHOLE.name]
    other = TargetTensor("norm.weight.exp_avg", "float32", (4,), None, None)
    with pytest.raises(SnapshotLayoutMismatch, match=r"tensor norm.weight.exp_avg is in no rank of the snapshot \(1 such"):
        plan_rank([WHOLE, other], manifests, target_rank=0, same_world=False)


def test_replicas_are_read_from_the_own_rank_else_spread():
    """Replicated bytes (DTensor replicas, equal plain tensors) come from the restoring rank's
    own old file when it holds them, else from holders spread by the restoring rank: 8 new
    ranks restoring a tensor replicated on 4 old ranks read from all 4, not all from rank 0."""
    shape = (6, 4)
    replicated = {rank: [_record("w", "float32", box, shape), _plain(rank, 5)[1]]
                  for rank, box in enumerate(_layout(shape, (4,), (R,)))}
    index = LayoutIndex(replicated)
    whole = _target("w", "float32", ((0, 0), shape), shape)
    sources = [index.plan([whole, PLAIN], target_rank=rank, same_world=False) for rank in range(8)]
    assert [ranks_needed(plan) for plan in sources] == [[r % 4] for r in range(8)]


def test_an_irregular_tiling_is_planned_and_checked_per_tensor():
    """Boxes that are not a grid (an L-shaped split) still plan by checking every source, and
    a gap is refused naming the tensor."""
    shape = (4, 4)
    boxes = [((0, 0), (2, 4)), ((2, 0), (2, 1)), ((2, 1), (2, 3))]  # rows 0-1 whole; rows 2-3 split
    records = {rank: [_record("w", "float32", box, shape)] for rank, box in enumerate(boxes)}
    plan = LayoutIndex(records).plan([_target("w", "float32", ((0, 0), shape), shape)], target_rank=0,
                                     same_world=False)
    assert [p.source_rank for p in plan["w"]] == [0, 1, 2]
    del records[1]
    with pytest.raises(SnapshotLayoutMismatch, match="tensor w: the restoring rank's box .* is not covered"):
        LayoutIndex(records).plan([_target("w", "float32", ((0, 0), shape), shape)], target_rank=0,
                                  same_world=False)


def _grid_doc(**tensor):
    entry = {"name": "w", "dtype": "float32", "global_shape": [8, 2], "starts": [[0, 4, 2], [0, 0, 1]],
             "owners": [0, 1, 2]}
    entry.update(tensor)
    return {"format": "swap-state-layout", "version": 1, "world_size": 2, "tensors": [entry]}


def test_a_layout_index_round_trips_compactly():
    """Shard(0) over 1,024 ranks is a few runs, not 1,024 boxes."""
    shape = (4096, 8)
    records = {rank: [_record("w", "float32", box, shape)] for rank, box in enumerate(_layout(shape, (1024,), (S0,)))}
    raw = LayoutIndex(records).to_bytes()
    assert len(raw) < 300, raw
    target = _target("w", "float32", ((1020, 0), (8, 8)), shape)
    plan = LayoutIndex.from_bytes(raw, 1024).plan([target], target_rank=3, same_world=False)
    assert [p.source_rank for p in plan["w"]] == [255, 256]  # rows 1,020-1,023 and 1,024-1,027


@pytest.mark.parametrize("raw, message", [
    (b"\xff", "not JSON"),
    (json.dumps({**_grid_doc(), "format": "pickle"}).encode(), "not a swap-state-layout"),
    (json.dumps({**_grid_doc(), "world_size": 3}).encode(), "not the layout of 2 ranks"),
    (json.dumps(_grid_doc(starts=[[4, 4, 2], [0, 0, 1]])).encode(), "must rise from 0"),
    (json.dumps(_grid_doc(starts=[[0, 4, 3], [0, 0, 1]])).encode(), "must rise from 0 inside 8"),
    (json.dumps(_grid_doc(starts=[[0, 4, 2]])).encode(), "one list per dimension"),
    (json.dumps(_grid_doc(starts=[[0, 1, 8], [0, 0, 1]])).encode(), "cut in 8 shards, more than the 2 ranks"),
    (json.dumps(_grid_doc(owners=[0, 1, 3])).encode(), "must give each of 2 ranks a cell"),
    (json.dumps(_grid_doc(owners=[0, 5, 2])).encode(), "must give each of 2 ranks a cell of 2"),
    (json.dumps(_grid_doc(owners=[0, 1, 0])).encode(), "out of bounds"),
    (json.dumps(_grid_doc(owners=[-1, 0, 2])).encode(), "no rank holds w"),
    (json.dumps(_grid_doc(dtype="object")).encode(), "dtype of w is not supported"),
    (json.dumps({**_grid_doc(), "tensors": [_grid_doc()["tensors"][0]] * 2}).encode(), "named once"),
    (json.dumps({**_grid_doc(), "tensors": [{"name": "w", "records": [[7, {}]]}]}).encode(), "ranks below 2"),
])
def test_a_hostile_layout_index_is_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        LayoutIndex.from_bytes(raw, 2)


def test_a_mangled_layout_index_is_a_value_error_never_a_crash():
    """Every value of a valid layout.json swapped for another kind of value, one at a time:
    refused with ValueError (SnapshotCorruptError to the restore), or read; never another error."""
    overlapping = [((0, 0), (2, 4)), ((1, 0), (2, 4))]  # not a grid: kept as records
    records = {rank: [_record("w", "float32", box, (8, 6)), _plain(rank, 5)[1],
                      _record("v", "float32", overlapping[rank], (4, 4))]
               for rank, box in enumerate(_layout((8, 6), (2,), (S0,)))}
    doc = json.loads(LayoutIndex(records).to_bytes())
    assert {key for entry in doc["tensors"] for key in ("starts", "crc32s", "records") if key in entry} == \
        {"starts", "crc32s", "records"}
    replacements = [None, -2, 1 << 70, "x", [], {}, [1, 2], 0.5, True]

    def paths(node, prefix=()):
        yield prefix
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            yield from paths(child, (*prefix, key))

    tried = 0
    for path in list(paths(doc))[1:]:
        for value in replacements:
            tried += 1
            mangled = json.loads(json.dumps(doc))
            node = mangled
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            try:
                LayoutIndex.from_bytes(json.dumps(mangled).encode(), 2)
            except ValueError:
                pass
    assert tried > 300  # every value of the three kinds of entry
