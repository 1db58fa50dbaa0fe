"""Restore into a segment the trainer marked being written (it holds nothing to keep): each
tensor copied as soon as it is verified, while the next ones are read; a failure zeroes them."""

from __future__ import annotations

import pytest
from snapshot_kit import SPECS, flip_byte_of_tensor, metadata_for

from swap_state.common.segment import Word
from swap_state.common.snapshot_errors import SnapshotCorrupt
from swap_state.common.snapshot_format import rank_data_name
from swap_state.server.snapshot import staging
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.server.snapshot.restore import restore

# A tensor over 2^24 elements, several staging regions long and not a whole number of pages,
# followed by one whose offset in the file is therefore not page aligned.
LARGE = [("blocks.0.w.exp_avg", "float32", (4097, 4099)), ("blocks.0.b.exp_avg", "float32", (4099,)),
         *SPECS]


def _snapshot(make_segment, make_coordinator, specs):
    seg = make_segment("source", specs=specs)
    contents = seg.fill(8)
    coordinator = make_coordinator()
    status = coordinator.start(seg.source("job", 8, metadata_json=metadata_for(seg, step=8))).wait(60)
    assert status.state is SnapshotState.DURABLE
    return coordinator.directory, contents


def _marked_target(make_segment, specs):
    """A segment holding a torn state, marked being written as the trainer marks it."""
    seg = make_segment("target", specs=specs)
    seg.fill(1234)
    seg.header[Word.WRITING_STEP] = 1
    return seg


def _restore(directory, seg):
    return restore(directory, "job/step-8", seg.mm, seg.layout, header=seg.header, job_id="job", rank=0,
                   world_size=1)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "mlock-refused-read-into-memory"])
def test_a_marked_segment_gets_each_tensor_once_verified_bitwise(make_segment, make_coordinator, monkeypatch,
                                                                  pinned):
    directory, contents = _snapshot(make_segment, make_coordinator, LARGE)
    seg = _marked_target(make_segment, LARGE)
    if not pinned:
        monkeypatch.setattr(staging, "_mlock", lambda address, length: 12)  # ENOMEM
    copied_before_the_last_check = []
    real_verified = staging.PinnedFile.verified

    def verified(self, tensor):
        copied_before_the_last_check.append(seg.tensors()["blocks.0.w.exp_avg"] == contents["blocks.0.w.exp_avg"])
        return real_verified(self, tensor)

    monkeypatch.setattr(staging.PinnedFile, "verified", verified)
    result = _restore(directory, seg)
    assert (result.streamed, result.staged, result.step) == (True, True, 8)
    assert seg.tensors() == contents
    assert copied_before_the_last_check[-1]  # the first tensor landed while later ones were checked


@pytest.mark.parametrize("tensor", ["blocks.0.w.exp_avg", "emb.exp_avg"])
def test_a_corrupt_tensor_is_named_and_the_marked_segment_zeroed(make_segment, make_coordinator, tensor):
    directory, _ = _snapshot(make_segment, make_coordinator, LARGE)
    path = directory.resolve("job/step-8").path / rank_data_name(0)
    flip_byte_of_tensor(path, tensor, at=17 << 20 if tensor.startswith("blocks") else 7)  # the large one: its 3rd block
    seg = _marked_target(make_segment, LARGE)
    with pytest.raises(SnapshotCorrupt) as caught:
        _restore(directory, seg)
    assert str(path) in str(caught.value) and repr(tensor) in str(caught.value)
    assert all(value == bytes(len(value)) for value in seg.tensors().values())  # fresh again
    assert seg.header[Word.WRITING_STEP] == 1  # the trainer's word: still marked


def test_an_unmarked_segment_is_staged_and_left_untouched_on_failure(make_segment, make_coordinator):
    directory, contents = _snapshot(make_segment, make_coordinator, SPECS)
    seg = make_segment("target", specs=SPECS)
    seg.fill(1234)
    before = seg.tensor_area()
    path = directory.resolve("job/step-8").path / rank_data_name(0)
    flip_byte_of_tensor(path, "emb.exp_avg", at=7)
    with pytest.raises(SnapshotCorrupt):
        _restore(directory, seg)
    assert seg.tensor_area() == before
    flip_byte_of_tensor(path, "emb.exp_avg", at=7)  # back as it was
    result = _restore(directory, seg)
    assert (result.streamed, result.staged) == (False, True) and seg.tensors() == contents
