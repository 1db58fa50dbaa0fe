"""The write seam on its own: a durable local snapshot copied into the store through the
store's TierWriter (copy_rank) is the same bytes, complete only with its marker and index; a
local file that changed since its snapshot never completes an object; a copy of a step the
store holds already puts nothing."""

from __future__ import annotations

import threading

import pytest

from swap_state.common.object_store import PosixObjectStore
from swap_state.common.snapshot_errors import SnapshotCorruptError
from swap_state.common.snapshot_format import rank_data_name, rank_manifest_name
from swap_state.common.stored_snapshots import StoredSnapshots, marker_name
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.server.snapshot.tiers.seam import StepPlan, copy_rank
from swap_state.server.snapshot.tiers.store import StoreTier
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter


@pytest.fixture
def durable(make_segment, make_coordinator):
    seg = make_segment()
    seg.fill(3)
    coordinator = make_coordinator()
    assert coordinator.start(seg.source("job", 2)).wait(20).state is SnapshotState.DURABLE
    return coordinator.local, coordinator.local.resolve("job/step-2")


def _stored(tmp_path) -> StoredSnapshots:
    store = PosixObjectStore(tmp_path / "store")
    store.create_root()  # as the server does at start
    return StoredSnapshots(store)


def _copy(local, info, tier: StoreTier) -> tuple[int, ...]:
    index = info.index
    plan = StepPlan(info.job_id, info.step, info.world_size, info.ranks, index.tenant, None, source=index)
    target = tier.prepare(plan)
    for rank in target.ranks:
        copy_rank(local, info, rank, tier, target, BandwidthLimiter(None), threading.Event(), lambda size: None)
    tier.finish(target, index, local.read_layout(info))
    return target.ranks


def test_a_copy_is_the_same_bytes_and_complete_with_its_marker_and_index(durable, tmp_path):
    local, info = durable
    stored = _stored(tmp_path)
    assert _copy(local, info, StoreTier(stored)) == (0,)
    copied = stored.resolve("job/latest")
    assert copied.step == 2 and copied.index.layout is not None
    for name in (rank_data_name(0), rank_manifest_name(0)):
        assert stored.store.get(stored.key("job", 2, name)) == (info.path / name).read_bytes()
    assert _copy(local, info, StoreTier(stored)) == ()  # the store holds it: nothing is put again


def test_a_local_file_changed_since_its_snapshot_never_completes_an_object(durable, tmp_path):
    local, info = durable
    data = info.path / rank_data_name(0)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the last byte: the check before the last block is final
    data.write_bytes(bytes(raw))
    stored = _stored(tmp_path)
    with pytest.raises(SnapshotCorruptError, match="no longer matches"):
        _copy(local, info, StoreTier(stored))
    keys = [o.key for o in stored.store.list("")]
    assert stored.key("job", 2, rank_data_name(0)) not in keys and stored.key("job", 2, marker_name(0)) not in keys
    assert stored.list("job") == []
