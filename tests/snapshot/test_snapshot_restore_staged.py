"""Restore stages every source tensor once (a file on this host mapped and pinned, else read into
memory), verifies it, and copies only once every checksum passed; bounded by the budget, else
verify-then-copy, logged."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging

import pytest
from snapshot_kit import flip_byte, metadata_for

from swap_state.common.object_store import PosixObjectStore
from swap_state.common.snapshot_errors import SnapshotCorrupt
from swap_state.common.snapshot_format import rank_data_name
from swap_state.common.snapshot_reader import SnapshotReader, SnapshotTier
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.snapshot import restore as restore_module
from swap_state.server.snapshot import staging as staging_module
from swap_state.server.snapshot.restore import restore
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.server.snapshot.directory import SnapshotDirectory

from test_snapshot_restore import _tensor_data_offset

SPECS = [
    ("a.exp_avg", "float32", (3, 5000)),  # 60000 bytes: spans several 8 KiB regions
    ("b.exp_avg", "bfloat16", (7, 1000)),
    ("c.exp_avg", "uint8", (12345,)),
    ("d.exp_avg", "float32", (0, 4)),
]


@pytest.fixture
def snapshot(make_segment, make_coordinator, monkeypatch):
    monkeypatch.setattr(staging_module, "STAGE_REGION_BYTES", 8192)  # many regions, small file
    seg = make_segment("source", specs=SPECS)
    contents = seg.fill(21)
    coordinator = make_coordinator()
    status = coordinator.start(seg.source("job", 3, metadata_json=metadata_for(seg, step=3))).wait(20)
    assert status.state is SnapshotState.DURABLE
    return coordinator.directory, coordinator.directory.resolve("job/step-3"), contents


def _target(make_segment):
    seg = make_segment("target", specs=SPECS)
    seg.fill(99)
    return seg, seg.tensor_area()


def _restore(store, seg, **kwargs):
    return restore(store, "job/latest", seg.mm, seg.layout, header=seg.header, rank=0, world_size=1, **kwargs)


def _no_reads_into_memory(monkeypatch):
    def refused(*args):
        raise AssertionError("a tensor was read into memory")

    monkeypatch.setattr(SnapshotTier, "read_tensor", refused)


def test_a_file_on_this_host_is_mapped_once_never_read_into_memory(snapshot, make_segment, monkeypatch):
    store, _, contents = snapshot
    _no_reads_into_memory(monkeypatch)
    mapped = []
    real_open = staging_module.os.open

    def counting_open(path, flags, *args, **kwargs):
        if str(path).endswith(rank_data_name(0)):
            assert not flags & staging_module.os.O_DIRECT  # through the page cache, mapped
            mapped.append(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(staging_module.os, "open", counting_open)
    seg, _ = _target(make_segment)
    result = _restore(store, seg)
    assert result.staged and result.step == 3
    assert seg.tensors() == contents
    assert len(mapped) == 2  # the header's read, then the one mapping


def test_a_directory_store_is_mapped_too(make_segment, make_coordinator, tmp_path, monkeypatch):
    source = make_segment("source", specs=SPECS)
    contents = source.fill(5)
    coordinator = make_coordinator(store_uri=str(tmp_path / "store"))
    coordinator.start(source.source("job", 3, metadata_json=metadata_for(source, step=3)))
    assert asyncio.run(coordinator.wait_status("job/step-3", 0, wait_s=30, wait_stored=True)).state.value == "stored"
    _no_reads_into_memory(monkeypatch)
    seg, _ = _target(make_segment)
    result = _restore(SnapshotDirectory(tmp_path / "another-host"), seg,
                      stored=StoredSnapshots(PosixObjectStore(tmp_path / "store")))
    assert result.source == "store" and seg.tensors() == contents


class _NotLocal(SnapshotReader):
    """A tier with no files on this host (as an object store): read through ``_read_range``."""

    def local_file(self, info, name):
        return None


@pytest.mark.parametrize("corrupt", [None, "a.exp_avg"])
def test_a_tier_without_local_files_is_read_into_memory(snapshot, make_segment, corrupt):
    store, info, contents = snapshot
    seg, before = _target(make_segment)
    if corrupt:
        flip_byte(info.path / rank_data_name(0), _tensor_data_offset(info, corrupt))
        with pytest.raises(SnapshotCorrupt, match=f"{rank_data_name(0)}: tensor '{corrupt}' fails its checksum"):
            _restore(_NotLocal(store.root), seg)
        assert seg.tensor_area() == before
        return
    assert _restore(_NotLocal(store.root), seg).staged and seg.tensors() == contents


@pytest.mark.parametrize("tensor", ["a.exp_avg", "c.exp_avg"])
def test_a_corrupt_region_changes_nothing_and_names_file_and_tensor(snapshot, make_segment, tensor,
                                                                    monkeypatch):
    store, info, _ = snapshot
    flip_byte(info.path / rank_data_name(0), _tensor_data_offset(info, tensor))
    seg, before = _target(make_segment)
    with pytest.raises(SnapshotCorrupt) as caught:
        _restore(store, seg)
    assert str(info.path / rank_data_name(0)) in str(caught.value) and repr(tensor) in str(caught.value)
    assert seg.tensor_area() == before


def test_a_budget_that_cannot_hold_the_state_falls_back_and_says_so(snapshot, make_segment, caplog):
    store, _, contents = snapshot
    asked = []

    @contextlib.contextmanager
    def refuse(nbytes):
        asked.append(nbytes)
        yield False

    seg, _ = _target(make_segment)
    with caplog.at_level(logging.WARNING, logger="swap_state.server.restore"):
        result = _restore(store, seg, reserve_staging=refuse, staging_free_bytes=lambda: 1234)
    assert not result.staged and seg.tensors() == contents
    assert asked == [sum(len(b) for b in contents.values())]
    [fields] = [r.swap_state_fields for r in caplog.records if r.msg == "restore_unstaged"]
    assert fields["staged_bytes_needed"] == asked[0] and fields["budget_free_bytes"] == 1234


def test_the_budget_holds_the_staged_bytes_only_while_restoring(snapshot, make_segment, monkeypatch):
    store, _, contents = snapshot
    held = []

    @contextlib.contextmanager
    def grant(nbytes):
        held.append(nbytes)
        yield True
        held.remove(nbytes)

    seg, _ = _target(make_segment)
    real = restore_module.staged_tensors

    def spy(*args, **kwargs):
        assert held == [sum(len(b) for b in contents.values())]
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_module, "staged_tensors", spy)
    assert _restore(store, seg, reserve_staging=grant).staged
    assert held == [] and seg.tensors() == contents


def test_a_tensor_mlock_refuses_is_read_into_memory_instead(snapshot, make_segment, monkeypatch, caplog):
    store, _, contents = snapshot
    monkeypatch.setattr(staging_module, "_mlock", lambda address, length: errno.ENOMEM)
    read = []
    real_read = SnapshotTier.read_tensor
    monkeypatch.setattr(SnapshotTier, "read_tensor", lambda *args: read.append(args[3].name) or real_read(*args))
    seg, _ = _target(make_segment)
    with caplog.at_level(logging.WARNING, logger="swap_state.server.restore"):
        result = _restore(store, seg)
    assert result.staged and seg.tensors() == contents
    assert sorted(read) == ["a.exp_avg", "b.exp_avg", "c.exp_avg"]  # not the empty one
    assert [r.msg for r in caplog.records].count("restore_unpinned") == 1


def test_a_file_changed_between_the_checks_and_the_copy_fails_saying_restore_again(snapshot, make_segment,
                                                                                    monkeypatch):
    store, info, _ = snapshot

    @contextlib.contextmanager
    def refuse(nbytes):
        yield False

    passes = []
    real = restore_module.staged_tensors

    def changed_underneath(tier, info_, wanted):
        passes.append([t.name for _, tensors in wanted.values() for t in tensors])
        if len(passes) == 4:  # the three tensors verified (the empty one has no piece): the copies
            flip_byte(info.path / rank_data_name(0), _tensor_data_offset(info, "b.exp_avg"))
        return real(tier, info_, wanted)

    monkeypatch.setattr(restore_module, "staged_tensors", changed_underneath)
    seg = make_segment("target2", specs=SPECS)
    with pytest.raises(SnapshotCorrupt, match="'b.exp_avg' fails its checksum.*changed while being restored.*restore again"):
        _restore(store, seg, reserve_staging=refuse)
