"""Restore reads each chunk once: staged (mapped, pinned), verified, and copied only once
every checksum passed; bounded by the budget, else today's verify-then-copy, logged."""

from __future__ import annotations

import contextlib
import errno
import logging

import pytest
from snapshot_kit import flip_byte, metadata_for

from swap_state.common.snapshot_errors import SnapshotCorrupt
from swap_state.common.snapshot_format import rank_data_name
from swap_state.server.snapshot import sources as sources_module
from swap_state.server.snapshot.restore import restore
from swap_state.server.snapshot.coordinator import SnapshotState

from test_snapshot_restore import _tensor_data_offset

SPECS = [
    ("a.exp_avg", "float32", (3, 5000)),  # 60000 bytes: spans several 8 KiB regions
    ("b.exp_avg", "bfloat16", (7, 1000)),
    ("c.exp_avg", "uint8", (12345,)),
    ("d.exp_avg", "float32", (0, 4)),
]


@pytest.fixture
def snapshot(make_segment, make_coordinator, monkeypatch):
    monkeypatch.setattr(sources_module, "STAGE_REGION_BYTES", 8192)  # many regions, small file
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


def test_staged_restore_reads_once_and_never_verifies_twice(snapshot, make_segment, monkeypatch):
    store, _, contents = snapshot

    opened = []
    real_open = sources_module.os.open

    def counting_open(path, flags, *args, **kwargs):
        opened.append(str(path))
        if str(path).endswith(rank_data_name(0)):
            assert not flags & sources_module.os.O_DIRECT  # through the page cache, mapped
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(sources_module.os, "open", counting_open)
    seg, _ = _target(make_segment)
    result = _restore(store, seg)
    assert result.staged and result.step == 3
    assert seg.tensors() == contents
    assert [p for p in opened if p.endswith(rank_data_name(0))] and len(
        [p for p in opened if p.endswith(rank_data_name(0))]
    ) == 1


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
    real = sources_module.copy_whole_file

    def spy(*args):
        assert held == [sum(len(b) for b in contents.values())]
        return real(*args)

    monkeypatch.setattr(sources_module, "copy_whole_file", spy)
    assert _restore(store, seg, reserve_staging=grant).staged
    assert held == [] and seg.tensors() == contents


def test_unpinned_staging_checks_every_copy_again(snapshot, make_segment, monkeypatch, caplog):
    store, info, contents = snapshot
    monkeypatch.setattr(sources_module, "_mlock", lambda address, length: errno.ENOMEM)
    seg, _ = _target(make_segment)
    with caplog.at_level(logging.WARNING, logger="swap_state.server.restore"):
        result = _restore(store, seg)
    assert result.staged and not result.pinned and seg.tensors() == contents
    assert any(r.msg == "restore_unpinned" for r in caplog.records)

    # A file that changes after it was verified (its pages were not pinned) fails the restore.
    real_copy = sources_module._copy_staged

    def changed_underneath(staged, manifest, view, layout, path):
        flip_byte(path, _tensor_data_offset(info, "b.exp_avg"))
        return real_copy(staged, manifest, view, layout, path)

    monkeypatch.setattr(sources_module, "_copy_staged", changed_underneath)
    seg2 = make_segment("target2", specs=SPECS)
    with pytest.raises(SnapshotCorrupt, match="changed while being restored.*'b.exp_avg'.*restore again"):
        _restore(store, seg2)
