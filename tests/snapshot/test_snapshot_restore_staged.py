"""Restore reads every source tensor once (a file on this host with O_DIRECT through a small ring
of reused buffers, else into memory) and checks it as it passes. A running trainer's state is
copied aside first (the segment's copy slots, else memory the budget lends) and put back when a
checksum fails; where neither holds it, every checksum is checked first and the file read again,
logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import pytest
from snapshot_kit import flip_byte, metadata_for

from swap_state.common.object_store import PosixObjectStore
from swap_state.common.snapshot_errors import SnapshotCorruptError
from swap_state.common.snapshot_format import rank_data_name
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.common.snapshot_tier import SnapshotTier
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.snapshot.restoring import restore as restore_module
from swap_state.server.snapshot.restoring import restore_reads as staging_module
from swap_state.server.snapshot.restoring.restore import restore
from swap_state.server.snapshot.coordinator import SnapshotState

from test_snapshot_restore import _tensor_data_offset

SPECS = [
    ("a.exp_avg", "float32", (3, 5000)),  # 60000 bytes: spans several 8 KiB blocks
    ("b.exp_avg", "bfloat16", (7, 1000)),
    ("c.exp_avg", "uint8", (12345,)),
    ("d.exp_avg", "float32", (0, 4)),
]
STATE_BYTES = 60000 + 14000 + 12345


@pytest.fixture
def snapshot(make_segment, make_coordinator, monkeypatch):
    monkeypatch.setattr(staging_module, "BLOCK_BYTES", 8192)  # many blocks, small file
    seg = make_segment("source", specs=SPECS)
    contents = seg.fill(21)
    coordinator = make_coordinator()
    status = coordinator.start(seg.source("job", 3, metadata_json=metadata_for(seg, step=3))).wait(20)
    assert status.state is SnapshotState.DURABLE
    return coordinator.local, coordinator.local.resolve("job/step-3"), contents


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


@pytest.mark.parametrize("cow_slots", [64, 0], ids=["aside-in-the-copy-slots", "aside-in-memory"])
def test_a_file_on_this_host_is_read_once_never_into_memory(snapshot, make_segment, monkeypatch, cow_slots):
    store, _, contents = snapshot
    _no_reads_into_memory(monkeypatch)
    reads = []
    real_preadv = staging_module.os.preadv
    monkeypatch.setattr(staging_module.os, "preadv", lambda fd, buffers, at: reads.append(at) or real_preadv(fd, buffers, at))
    seg = make_segment("target", specs=SPECS, cow_slots=cow_slots)
    seg.fill(99)
    result = _restore(store, seg)
    assert (result.staged, result.kept, result.step) == (True, "slots" if cow_slots else "memory", 3)
    assert seg.tensors() == contents
    assert len(reads) == len(set(reads)) > 1  # each block once


def test_a_directory_store_is_read_from_its_files_too(make_segment, make_coordinator, tmp_path, monkeypatch):
    source = make_segment("source", specs=SPECS)
    contents = source.fill(5)
    coordinator = make_coordinator(store_uri=str(tmp_path / "store"))
    coordinator.start(source.source("job", 3, metadata_json=metadata_for(source, step=3)))
    assert asyncio.run(coordinator.wait_status("job/step-3", 0, wait_s=30, wait_stored=True)).state.value == "stored"
    _no_reads_into_memory(monkeypatch)
    seg, _ = _target(make_segment)
    result = _restore(SnapshotReader(tmp_path / "another-host"), seg,
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
        with pytest.raises(SnapshotCorruptError, match=f"{rank_data_name(0)}: tensor '{corrupt}' fails its checksum"):
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
    with pytest.raises(SnapshotCorruptError) as caught:
        _restore(store, seg)
    assert str(info.path / rank_data_name(0)) in str(caught.value) and repr(tensor) in str(caught.value)
    assert seg.tensor_area() == before


@pytest.mark.parametrize("cow_slots", [64, 0], ids=["aside-in-the-copy-slots", "aside-in-memory"])
@pytest.mark.parametrize("tensor", ["a.exp_avg", "c.exp_avg"])
def test_a_corrupt_tensor_leaves_the_kept_state_as_it_was(snapshot, make_segment, tensor, cow_slots):
    """The tensors before it were already copied in: they are put back."""
    store, info, _ = snapshot
    flip_byte(info.path / rank_data_name(0), _tensor_data_offset(info, tensor))
    seg = make_segment("target", specs=SPECS, cow_slots=cow_slots)
    seg.fill(99)
    before = seg.tensor_area()
    with pytest.raises(SnapshotCorruptError) as caught:
        _restore(store, seg)
    assert str(info.path / rank_data_name(0)) in str(caught.value) and repr(tensor) in str(caught.value)
    assert seg.tensor_area() == before


def test_neither_slots_nor_budget_verifies_first_reads_again_and_says_what_to_raise(snapshot, make_segment, caplog):
    store, _, contents = snapshot
    asked = []

    @contextlib.contextmanager
    def refuse(nbytes):
        asked.append(nbytes)
        yield False

    seg = make_segment("target", specs=SPECS, cow_slots=0)
    seg.fill(99)
    with caplog.at_level(logging.WARNING, logger="swap_state.server.snapshot.restoring.restore"):
        result = _restore(store, seg, reserve_staging=refuse, staging_free_bytes=lambda: 1234)
    assert (result.staged, result.kept) == (False, "verify-first") and seg.tensors() == contents
    assert asked == [STATE_BYTES]
    [record] = [r for r in caplog.records if r.msg == "restore_unstaged"]
    fields = record.swap_state_fields
    assert fields["kept_bytes"] == STATE_BYTES and fields["budget_free_bytes"] == 1234
    assert "--cow-budget" in fields["detail"]


def test_the_budget_lends_the_memory_only_while_restoring(snapshot, make_segment, monkeypatch):
    store, _, contents = snapshot
    held = []

    @contextlib.contextmanager
    def grant(nbytes):
        held.append(nbytes)
        yield True
        held.remove(nbytes)

    seg = make_segment("target", specs=SPECS, cow_slots=0)
    real = restore_module.stream_tensors

    def spy(*args, **kwargs):
        assert held == [STATE_BYTES]
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_module, "stream_tensors", spy)
    assert _restore(store, seg, reserve_staging=grant).kept == "memory"
    assert held == [] and seg.tensors() == contents


def test_a_filesystem_refusing_o_direct_is_read_buffered(snapshot, make_segment, monkeypatch):
    store, _, contents = snapshot
    real_open = staging_module.os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # as tmpfs answers
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(staging_module.os, "open", no_direct)
    seg, _ = _target(make_segment)
    assert _restore(store, seg).staged and seg.tensors() == contents


def test_a_file_changed_between_the_checks_and_the_copy_fails_saying_restore_again(snapshot, make_segment,
                                                                                    monkeypatch):
    store, info, _ = snapshot

    @contextlib.contextmanager
    def refuse(nbytes):
        yield False

    passes = []
    real = restore_module.stream_tensors

    def changed_underneath(tier, info_, wanted, deliver):
        passes.append(1)
        if len(passes) == 2:  # verified in the first pass: the second one copies
            flip_byte(info.path / rank_data_name(0), _tensor_data_offset(info, "b.exp_avg"))
        return real(tier, info_, wanted, deliver)

    monkeypatch.setattr(restore_module, "stream_tensors", changed_underneath)
    seg = make_segment("target2", specs=SPECS, cow_slots=0)
    with pytest.raises(SnapshotCorruptError, match="'b.exp_avg' fails its checksum.*changed while being restored.*restore again"):
        _restore(store, seg, reserve_staging=refuse)
