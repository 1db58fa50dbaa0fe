"""The zero-copy writer: a chunk overwritten while it is written or checksummed is rewritten
from its copy slot at the same file offset, and the file and its checksums stay exact; a held
writer streams only once told to."""

from __future__ import annotations

import time

import pytest
from snapshot_kit import verify_rank_file

from swap_state.common.segment import Word
from swap_state.common import checksum
from swap_state.server.snapshot.writing import writer as snapshot_writer
from swap_state.server.snapshot.writing.snapshot_file import SnapshotFile
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.common.snapshot_format import rank_data_name
from swap_state.common.copy_before_write import TrainerProtector

from test_snapshot_consistency import _file_tensors


def _overwrite_as_trainer(seg, chunk) -> None:
    """The trainer's side for one chunk: copy before write (slot, COW_EPOCH), then write."""
    protector = TrainerProtector(seg.mm, seg.layout, header=seg.header)
    assert protector.protect(chunk)
    protector.close()
    seg.mm[chunk.offset : chunk.offset + chunk.nbytes] = b"\xee" * chunk.nbytes


@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "buffered"])
@pytest.mark.parametrize("when", ["during-write", "during-crc"])
def test_chunk_overwritten_mid_read_is_rewritten_from_its_slot(make_segment, make_coordinator, monkeypatch,
                                                              when, direct):
    seg = make_segment(cow_slots=2)
    at_step_n = seg.fill(seed=5)
    victim = seg.chunks[3]  # inside the first tensor: its running crc continues across it
    assert victim.tensor_index == seg.chunks[2].tensor_index == seg.chunks[4].tensor_index
    if not direct:
        monkeypatch.setattr(SnapshotFile, "open_direct", lambda self: None)

    real_place, real_crc = snapshot_writer._place, checksum.crc32
    state = {"done": False}

    def is_victim(data) -> bool:
        return not state["done"] and bytes(data) == at_step_n_chunk and seg.header[Word.PERSISTED_UPTO] == victim.index

    at_step_n_chunk = bytes(seg.mm[victim.offset : victim.offset + victim.nbytes])

    def place(sink, data, stable):
        assert sink.direct is direct
        if when == "during-write" and is_victim(data):
            state["done"] = True
            _overwrite_as_trainer(seg, victim)
            data = memoryview(seg.mm)[victim.offset : victim.offset + victim.nbytes]  # torn: new bytes
        return real_place(sink, data, stable)

    def crc(data, value=0):
        if when == "during-crc" and is_victim(data):
            state["done"] = True
            _overwrite_as_trainer(seg, victim)
            data = memoryview(seg.mm)[victim.offset : victim.offset + victim.nbytes]
        return real_crc(data, value)

    monkeypatch.setattr(snapshot_writer, "_place", place)
    monkeypatch.setattr(checksum, "crc32", crc)  # the writer's tensor checksums
    coordinator = make_coordinator()
    handle = coordinator.start(seg.source("job", 4))
    status = handle.wait(20)
    assert state["done"]
    assert status.state is SnapshotState.DURABLE, status.error
    assert status.cow_copies == 1
    # The file holds step N's bytes, and its checksums (verified on restore) agree with them.
    assert _file_tensors(status.path + "/" + rank_data_name(0)) == at_step_n
    info = coordinator.local.resolve("job/step-4")
    verify_rank_file(coordinator.local, info)
    assert seg.mm[victim.offset : victim.offset + 1] == b"\xee"  # the trainer's write stands
    assert seg.header[Word.SNAP_EPOCH] == 0 and seg.slots_all_free()


def test_held_writer_streams_only_after_proceed(make_segment, make_coordinator, monkeypatch):
    monkeypatch.setattr(snapshot_writer, "HOLD_MAX_S", 30.0)
    seg = make_segment()
    at_step_n = seg.fill(seed=6)
    coordinator = make_coordinator()
    handle = coordinator.start(seg.source("job", 2), hold=True)
    assert seg.header[Word.SNAP_EPOCH] == handle.epoch != 0  # consistent on return
    time.sleep(0.2)
    assert handle.status().bytes_persisted == 0
    assert not handle.segment_released.wait(0)
    handle.proceed()
    status = handle.wait(20)
    assert status.state is SnapshotState.DURABLE, status.error
    assert _file_tensors(status.path + "/" + rank_data_name(0)) == at_step_n


def test_cancelling_a_held_writer_does_not_wait_for_the_hold(make_segment, make_coordinator, monkeypatch):
    monkeypatch.setattr(snapshot_writer, "HOLD_MAX_S", 30.0)
    seg = make_segment()
    seg.fill(seed=7)
    coordinator = make_coordinator()
    handle = coordinator.start(seg.source("job", 2), hold=True)
    t0 = time.monotonic()
    handle.cancel("test")
    status = handle.wait(10)
    assert status.state is SnapshotState.FAILED
    assert handle.segment_released.wait(5)
    assert time.monotonic() - t0 < 5
    assert seg.header[Word.SNAP_EPOCH] == 0
