"""A snapshot being assembled is read once for the ranks of a server that restore it together
(its layout index, or for a snapshot without one its manifests), and never served for a
snapshot that replaced it."""

from __future__ import annotations

import pathlib

from swap_state.common.snapshot_format import RankManifest, SnapshotIndex, TensorRecord
from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.server.snapshot.restoring.restore import RecentSnapshots
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex
from swap_state.server.snapshot.restoring.reshard import TargetTensor, ranks_needed


def _manifest(rank: int) -> RankManifest:
    record = TensorRecord("w", "float32", (2,), 8, (0, 8), 0, global_shape=(4,), global_offset=(2 * rank,))
    return RankManifest("job", 6, rank, 2, f"rank-{rank}.safetensors", 8, 0, 8, (record,), {}, {}, {}, 0, 0, 0.0, 0.0)


class CountingTier:
    """A tier holding one snapshot, whose manifests are counted as they are read."""

    where = "local"

    def __init__(self, attempt: int = 1):
        index = SnapshotIndex("job", 6, 2, (0, 1), (), 1.0, attempt)
        self.info = SnapshotInfo("job/step-6", "job", 6, 2, pathlib.Path("/snaps/job/step-6"), 0, True, index)
        self.reads: list[int] = []

    def read_layout(self, info: SnapshotInfo) -> bytes | None:
        return None  # a snapshot written before layout indexes: planned from its manifests

    def read_manifest(self, info: SnapshotInfo, rank: int) -> RankManifest:
        self.reads.append(rank)
        return _manifest(rank)


class IndexedTier(CountingTier):
    """A snapshot with a layout index: no manifest is read to plan, each needed one once."""

    def read_layout(self, info: SnapshotInfo) -> bytes | None:
        self.reads.append("layout")
        return LayoutIndex({r: _manifest(r).tensors for r in (0, 1)}).to_bytes()


def test_ranks_restoring_together_read_the_manifests_once():
    recent = RecentSnapshots(keep_s=60)
    tier = CountingTier()
    first, second = recent.read(tier, tier.info), recent.read(tier, tier.info)
    assert first is second and tier.reads == [0, 1]
    whole = TargetTensor("w", "float32", (4,), (4,), (0,))
    assert ranks_needed(first.index.plan([whole], target_rank=0, same_world=False)) == [0, 1]


def test_with_a_layout_index_only_the_needed_manifests_are_read_once():
    tier = IndexedTier()
    read = RecentSnapshots(keep_s=60).read(tier, tier.info)
    upper = TargetTensor("w", "float32", (2,), (4,), (2,))
    assert ranks_needed(read.index.plan([upper], target_rank=0, same_world=False)) == [1]
    assert read.manifest(1) is read.manifest(1)
    assert tier.reads == ["layout", 1]


def test_a_replaced_snapshot_is_read_again():
    recent = RecentSnapshots(keep_s=60)
    first = CountingTier(attempt=1)
    recent.read(first, first.info)
    again = CountingTier(attempt=2)  # the step trained again: the same id, another index
    recent.read(again, again.info)
    assert again.reads == [0, 1]


def test_an_entry_is_dropped_once_unused():
    recent = RecentSnapshots(keep_s=0.0)
    tier = CountingTier()
    read = recent.read(tier, tier.info)
    recent._release.join(timeout=10)  # the release timer ran
    assert recent.read(tier, tier.info) is read  # still in use here: shared
    del read
    tier.reads.clear()
    recent._release.join(timeout=10)
    recent.read(tier, tier.info)
    assert tier.reads == [0, 1]  # nobody held it: read anew


def test_another_snapshots_restore_does_not_wait_for_a_slow_read():
    """While one snapshot's manifests are being read (slowly, as from a store), a restore of
    another snapshot reads its own at once; a second rank of the slow one waits and shares."""
    import threading

    recent = RecentSnapshots(keep_s=60)
    release = threading.Event()
    started = threading.Event()

    class SlowTier(CountingTier):
        def read_manifest(self, info, rank):
            started.set()
            assert release.wait(timeout=30)
            return super().read_manifest(info, rank)

    slow, other = SlowTier(attempt=1), CountingTier(attempt=2)
    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", recent.read(slow, slow.info)))
    second = threading.Thread(target=lambda: results.setdefault("second", recent.read(slow, slow.info)))
    first.start()
    assert started.wait(timeout=30)
    second.start()
    assert recent.read(other, other.info) is not None and other.reads == [0, 1]  # not blocked by the slow read
    release.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert results["first"] is results["second"] and slow.reads == [0, 1]
