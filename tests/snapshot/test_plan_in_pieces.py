"""Planning costs O(pieces), not O(old ranks): a replicated plain tensor is one run of the
layout index and is planned without walking its holders; which holder a new rank reads and
when plain copies differ are decided from the runs alone."""

from __future__ import annotations

import json
import random

import pytest
from swap_state.common.snapshot_errors import SnapshotLayoutMismatch
from swap_state.common.snapshot_format import TensorRecord
from swap_state.server.snapshot.restoring import layout_index
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, Progression
from swap_state.server.snapshot.restoring.reshard import TargetTensor, ranks_needed

STEP = TargetTensor("step", "float32", (), None, None)


def _plain_index(crcs: list[int]) -> LayoutIndex:
    """The layout of a plain float32 scalar: ``crcs[rank]`` per old rank, -1 where it holds none."""
    records = {rank: [TensorRecord("step", "float32", (), 4, (0, 4), crc)] if crc != -1 else []
               for rank, crc in enumerate(crcs)}
    index = LayoutIndex({rank: held for rank, held in records.items() if held}, len(crcs))
    return LayoutIndex.from_bytes(index.to_bytes(), len(crcs))


def test_a_replicated_plain_tensor_is_planned_without_walking_its_ranks(monkeypatch):
    world = 1 << 20
    doc = (b'{"format":"swap-state-layout","version":1,"world_size":%d,"tensors":[{"name":"step",'
           b'"dtype":"float32","shape":[],"crc32s":[7,0,%d]}]}' % (world, world))
    index = LayoutIndex.from_bytes(doc, world)

    def walked(self):
        raise AssertionError("walked every old rank")
    monkeypatch.setattr(Progression, "__iter__", walked)
    for rank in (0, 5, world - 1, world + 3):
        [piece] = index.plan([STEP], target_rank=rank, same_world=False)["step"]
        assert piece.source_rank == rank % world and piece.source.crc32 == 7


def test_holders_with_gaps_are_spread_over_the_holders_only():
    # Ranks 2-3 and 6 hold nothing (other pipeline stages); equal bytes elsewhere.
    crcs = [5, 5, -1, -1, 5, 5, -1, 5]
    index = _plain_index(crcs)
    holders = [r for r, crc in enumerate(crcs) if crc != -1]
    for rank in range(16):
        want = rank if rank < len(crcs) and crcs[rank] != -1 else holders[rank % len(holders)]
        assert ranks_needed(index.plan([STEP], target_rank=rank, same_world=False)) == [want]


@pytest.mark.parametrize("crcs", [[5, -1, 5], [5, 6, 5], [-1, 5, 6], [5, 5, 5, 9]])
def test_differing_plain_copies_are_found_from_the_runs(crcs):
    index = _plain_index(crcs)
    differ = len({c for c in crcs if c != -1}) > 1
    assert (len(index._tensors["step"].held()) > 1) is differ  # noqa: SLF001 (the runs' verdict itself)
    if differ:
        first = next(r for r, c in enumerate(crcs) if c != -1)
        other = next(r for r, c in enumerate(crcs) if c not in (-1, crcs[first]))
        with pytest.raises(SnapshotLayoutMismatch, match=rf"differs between the snapshot's ranks \({first} and {other}\)"):
            index.plan([STEP], target_rank=len(crcs), same_world=False)
        own = crcs.index(crcs[other])
        assert ranks_needed(index.plan([STEP], target_rank=own, same_world=True)) == [own]


def test_a_layout_module_keeps_one_planner():
    """The per-tensor planner checks what the index chose; no second plain path beside it."""
    assert not hasattr(layout_index._Plain, "holders")  # noqa: SLF001


def _sequences():
    """Sequences a layout holds (TP inside FSDP owners, replicated cells, gaps) and random ones."""
    dp, tp = 6, 4
    yield [t * dp + d for d in range(dp) for t in range(tp)]  # col-wise TP x FSDP: cell of rank d*tp+t
    yield [d for d in range(dp) for _ in range(tp)]  # replicated over TP
    yield [d if d < 3 else -1 for d in range(dp) for _ in range(tp)]  # short tensor: empty shards
    yield [5, -1, 5, 5, -1, 5, 5]
    rng = random.Random(51)
    for _ in range(200):
        yield [rng.choice([-1, 0, 1, 2, 7]) if rng.random() < 0.5 else rng.randrange(-1, 9) for _ in range(rng.randrange(1, 30))]


@pytest.mark.parametrize("values", list(_sequences()))
def test_a_progression_is_its_values(values):
    runs = Progression.of(values)
    read = Progression.from_flat(json.loads(json.dumps(runs.flat())), "x")
    for seq in (runs, read):
        assert list(seq) == values and [seq[i] for i in range(len(values))] == values
        for value in set(values):
            assert sorted(i for r in seq.positions(value) for i in r) == [i for i, v in enumerate(values) if v == value]
        assert seq.bounds() == (min(values), max(values))
    rising = sorted(set(values))
    assert [Progression.of(rising).count_at_most(v) for v in range(-2, 10)] == \
        [sum(x <= v for x in rising) for v in range(-2, 10)]
    assert Progression.of(rising).rising() and (Progression.of(values).rising() == (values == rising))


def test_tp_inside_fsdp_is_one_run_per_tensor():
    """The owners of a col-wise TP8 x FSDP tensor at 16,384 ranks: one run, not 2,048."""
    dp, tp = 2048, 8
    assert len(Progression.of([t * dp + d for d in range(dp) for t in range(tp)]).runs) == 1
    assert len(Progression.of([d for d in range(dp) for _ in range(tp)]).runs) == 1
