"""Restore into a segment the trainer marked being written (it holds nothing to keep): the bytes
copied in as they are read and checked; a failure zeroes them."""

from __future__ import annotations

import pytest
from snapshot_kit import SPECS, flip_byte_of_tensor, metadata_for

from swap_state.common.segment import Word
from swap_state.common.snapshot_errors import SnapshotCorruptError
from swap_state.common.snapshot_format import rank_data_name
from swap_state.server.snapshot.restoring import restore_reads as staging
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.server.snapshot.restoring.restore import restore

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
    return coordinator.local, contents


def _marked_target(make_segment, specs):
    """A segment holding a torn state, marked being written as the trainer marks it."""
    seg = make_segment("target", specs=specs)
    seg.fill(1234)
    seg.header[Word.WRITING_STEP] = 1
    return seg


def _restore(directory, seg):
    return restore(directory, "job/step-8", seg.mm, seg.layout, header=seg.header, job_id="job", rank=0,
                   world_size=1)


def test_a_marked_segment_gets_each_tensor_as_it_is_read_bitwise(make_segment, make_coordinator, monkeypatch):
    monkeypatch.setattr(staging, "BLOCK_BYTES", 4 << 20)  # the large tensor: several blocks
    directory, contents = _snapshot(make_segment, make_coordinator, LARGE)
    seg = _marked_target(make_segment, LARGE)
    copied_before_the_last_read = []
    real_preadv = staging.os.preadv
    head = contents["blocks.0.w.exp_avg"][:1 << 20]

    def preadv(fd, buffers, at):
        copied_before_the_last_read.append(seg.tensors()["blocks.0.w.exp_avg"][:1 << 20] == head)
        return real_preadv(fd, buffers, at)

    monkeypatch.setattr(staging.os, "preadv", preadv)
    result = _restore(directory, seg)
    assert (result.streamed, result.staged, result.kept, result.step) == (True, True, "nothing", 8)
    assert seg.tensors() == contents
    assert copied_before_the_last_read[-1]  # the first tensor's first bytes landed while later ones were read


@pytest.mark.parametrize("tensor", ["blocks.0.w.exp_avg", "emb.exp_avg"])
def test_a_corrupt_tensor_is_named_and_the_marked_segment_zeroed(make_segment, make_coordinator, tensor):
    directory, _ = _snapshot(make_segment, make_coordinator, LARGE)
    path = directory.resolve("job/step-8").path / rank_data_name(0)
    flip_byte_of_tensor(path, tensor, at=17 << 20 if tensor.startswith("blocks") else 7)  # the large one: its 3rd block
    seg = _marked_target(make_segment, LARGE)
    with pytest.raises(SnapshotCorruptError) as caught:
        _restore(directory, seg)
    assert str(path) in str(caught.value) and repr(tensor) in str(caught.value)
    assert all(value == bytes(len(value)) for value in seg.tensors().values())  # fresh again
    assert seg.header[Word.WRITING_STEP] == 1  # the trainer's word: still marked


def test_an_unmarked_segment_is_kept_aside_and_left_untouched_on_failure(make_segment, make_coordinator):
    directory, contents = _snapshot(make_segment, make_coordinator, SPECS)
    seg = make_segment("target", specs=SPECS)
    seg.fill(1234)
    before = seg.tensor_area()
    path = directory.resolve("job/step-8").path / rank_data_name(0)
    flip_byte_of_tensor(path, "emb.exp_avg", at=7)
    with pytest.raises(SnapshotCorruptError):
        _restore(directory, seg)
    assert seg.tensor_area() == before
    flip_byte_of_tensor(path, "emb.exp_avg", at=7)  # back as it was
    result = _restore(directory, seg)
    assert (result.streamed, result.staged, result.kept) == (False, True, "slots+memory") and seg.tensors() == contents
