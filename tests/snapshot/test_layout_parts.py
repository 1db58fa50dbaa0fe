"""The step's layout index merged from every host's part (``layout_part``,
``LayoutIndex.merged``) is the one built from every rank's manifest, whatever the hosts' ranks."""

from __future__ import annotations

import random

import pytest

from bench.scale import Layout, manifests
from swap_state.common.snapshot_format import TensorRecord
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, bind, layout_part
from swap_state.server.snapshot.restoring.reshard import TargetTensor


def _merged(records: dict, world: int, hosts: list[list[int]]) -> LayoutIndex:
    shared: dict = {}  # as the publisher reads each distinct names object once
    parts = []
    for ranks in hosts:
        kinds, names, kind_of = layout_part({r: records[r] for r in ranks})
        names, kind_of = shared.setdefault((tuple(names), tuple(kind_of)), (names, kind_of))
        parts.append((kinds, names, kind_of))
    random.Random(0).shuffle(parts)
    return LayoutIndex.merged(parts, world)


@pytest.mark.parametrize("name,world", [("70b-fsdp", 24), ("405b-tp8", 32), ("405b-fsdp", 40)])
def test_the_index_merged_from_host_parts_is_the_one_from_every_manifest(name, world):
    records = manifests(Layout.named(name), world)
    whole = LayoutIndex(records, world).to_bytes()
    contiguous = [list(range(h, min(h + 8, world))) for h in range(0, world, 8)]
    strided = [list(range(h, world, 3)) for h in range(3)]  # hosts whose ranks interleave, uneven
    assert _merged(records, world, contiguous).to_bytes() == whole
    assert _merged(records, world, strided).to_bytes() == whole


def test_irregular_and_plain_tensors_merge_to_the_same_plans():
    world = 4
    records = {r: [TensorRecord("odd", "float32", (r + 1,), 4 * (r + 1), (0, 4 * (r + 1)), r, global_shape=(10,),
                                global_offset=(r * (r + 1) // 2,)),  # uneven shards: kept as records
                   TensorRecord("plain", "float32", (3,), 12, (12, 24), 100 + r % 2)] for r in range(world)}
    whole, merged = LayoutIndex(records, world), _merged(records, world, [[0, 3], [1], [2]])
    targets = [TargetTensor("odd", "float32", (5,), (10,), (5,)), TargetTensor("plain", "float32", (3,), None, None)]
    for rank in range(world):  # bound to the manifests' records, as a restore does
        assert bind(merged.plan(targets, target_rank=rank, same_world=True), records) == \
            bind(whole.plan(targets, target_rank=rank, same_world=True), records)


def test_parts_that_do_not_cover_their_tensors_once_are_refused():
    records = manifests(Layout.named("70b-fsdp"), 8)
    part = layout_part({r: records[r] for r in range(4)})
    with pytest.raises(ValueError, match="held twice"):
        LayoutIndex.merged([part, part], 8)
    with pytest.raises(ValueError, match="do not merge"):
        LayoutIndex.merged([([[["x"]]], part[1], part[2])], 8)
