"""A snapshot of step N equals step N's bytes while the trainer keeps stepping."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors import safe_open
from snapshot_kit import Trainer, metadata_for

from swap_state.common.segment import Word
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.common.snapshot_errors import SnapshotBusyError, SnapshotFailedError
from swap_state.common.snapshot_format import rank_data_name


def _file_tensors(path) -> dict[str, bytes]:
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            out[name] = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize("cow_slots", [3, 0], ids=["few-slots", "no-slots"])
def test_snapshot_is_exact_while_trainer_mutates(make_segment, make_coordinator, cow_slots):
    seg = make_segment(cow_slots=cow_slots)
    at_step_n = seg.fill(seed=10)
    # ~90 KiB at 150 KB/s: the writer needs ~0.6 s, the trainer would need microseconds.
    coordinator = make_coordinator(max_bandwidth=150_000)
    handle = coordinator.start(seg.source("job", 10, metadata_json=metadata_for(seg)))
    assert seg.header[Word.SNAP_EPOCH] == handle.epoch != 0  # consistent on return
    assert seg.header[Word.SNAP_STEP] == 10

    trainer = Trainer(seg, first_step=11, n_steps=3)
    trainer.start()
    status = handle.wait(timeout=20)
    trainer.join(timeout=20)
    assert trainer.error is None
    assert status.state is SnapshotState.DURABLE, status.error

    # The trainer's writes all landed; the snapshot holds step N, bit for bit.
    assert seg.tensors() == trainer.expected_final()
    assert _file_tensors(status.path + "/" + rank_data_name(0)) == at_step_n
    assert status.bytes_persisted == status.bytes_total == sum(len(b) for b in at_step_n.values())
    # The trainer had to work around the slow writer, and it was counted, not hidden.
    if cow_slots:
        assert status.cow_copies > 0
        assert status.cow_copies == trainer.copies
    assert status.backpressure_waits > 0
    assert status.backpressure_wait_seconds > 0
    manifest = coordinator.local.read_manifest(coordinator.local.resolve("job/step-10"), 0)
    assert (manifest.cow_copies, manifest.backpressure_waits) == (status.cow_copies, status.backpressure_waits)
    # The segment is handed back clean: no epoch, every slot free.
    assert seg.header[Word.SNAP_EPOCH] == 0
    assert seg.slots_all_free()


def test_next_snapshot_after_mutation_holds_the_new_step(make_segment, make_coordinator):
    seg = make_segment(cow_slots=2)
    seg.fill(seed=1)
    coordinator = make_coordinator(max_bandwidth=400_000)
    first = coordinator.start(seg.source("job", 1))
    trainer = Trainer(seg, first_step=2, n_steps=2)
    trainer.start()
    assert first.wait(20).state is SnapshotState.DURABLE
    trainer.join(20)
    assert trainer.error is None
    second = coordinator.start(seg.source("job", 3))
    assert second.epoch > first.epoch
    status = second.wait(20)
    assert status.state is SnapshotState.DURABLE
    assert status.cow_copies == 0  # nobody wrote during this one
    assert _file_tensors(status.path + "/" + rank_data_name(0)) == trainer.expected_final()


def test_snapshot_refused_while_trainer_writes_or_segment_busy(make_segment, make_coordinator):
    seg = make_segment()
    seg.fill(seed=2)
    coordinator = make_coordinator(max_bandwidth=100_000)
    seg.header[Word.WRITING_STEP] = 6
    with pytest.raises(SnapshotBusyError, match="writing step 5"):
        coordinator.start(seg.source("job", 5))
    seg.header[Word.WRITING_STEP] = 0
    handle = coordinator.start(seg.source("job", 5))
    assert coordinator.start(seg.source("job", 5)) is handle  # a retried RPC
    with pytest.raises(SnapshotBusyError, match="still persisting job/step-5"):
        coordinator.start(seg.source("job", 6))
    assert handle.wait(20).state is SnapshotState.DURABLE


def test_multi_rank_snapshot_is_durable_only_with_all_ranks(make_segment, make_coordinator):
    seg0, seg1 = make_segment("r0"), make_segment("r1")
    bytes0, bytes1 = seg0.fill(seed=3), seg1.fill(seed=4)
    coordinator = make_coordinator()
    h0 = coordinator.start(seg0.source("job", 9, rank=0, world_size=2))
    assert h0.segment_released.wait(10)
    status = h0.wait(timeout=0.3)
    assert status.state is SnapshotState.PERSISTING  # rank 1 has not started
    assert (status.ranks_joined, status.ranks_persisted) == (1, 1)
    assert coordinator.local.list("job") == []
    h1 = coordinator.start(seg1.source("job", 9, rank=1, world_size=2))
    assert h1.wait(20).state is SnapshotState.DURABLE
    assert h0.status().state is SnapshotState.DURABLE
    [info] = coordinator.local.list("job")
    assert info.world_size == 2 and info.latest
    assert [f.name for f in info.index.files] == [
        "rank-00000.safetensors", "rank-00000.manifest.json",
        "rank-00001.safetensors", "rank-00001.manifest.json",
    ]
    assert _file_tensors(info.path / rank_data_name(0)) == bytes0
    assert _file_tensors(info.path / rank_data_name(1)) == bytes1


def test_missing_rank_times_out_and_leaves_nothing(make_segment, make_coordinator):
    seg0, seg1 = make_segment("r0"), make_segment("r1")
    seg0.fill(seed=5)
    coordinator = make_coordinator(assemble_timeout_s=0.3)
    h0 = coordinator.start(seg0.source("job", 4, rank=0, world_size=2))
    status = h0.wait(timeout=10)
    assert status.state is SnapshotState.FAILED
    assert "only ranks [0] of world_size 2" in status.error
    assert isinstance(h0.exception, SnapshotFailedError)
    assert seg0.header[Word.SNAP_EPOCH] == 0
    # The late rank learns of the failure at once instead of waiting for a doomed group.
    with pytest.raises(SnapshotFailedError, match="only ranks"):
        coordinator.start(seg1.source("job", 4, rank=1, world_size=2))
    job_dir = coordinator.local.job_dir("job")
    assert [p.name for p in job_dir.iterdir()] == []
    # A participant's retry is a fresh attempt, which the other rank may then join.
    h0 = coordinator.start(seg0.source("job", 4, rank=0, world_size=2))
    h1 = coordinator.start(seg1.source("job", 4, rank=1, world_size=2))
    assert h1.wait(20).state is SnapshotState.DURABLE
    assert h0.status().state is SnapshotState.DURABLE


def test_status_in_progress_and_from_disk(make_segment, make_coordinator, tmp_path):
    seg = make_segment()
    seg.fill(seed=6)
    coordinator = make_coordinator(max_bandwidth=200_000)
    handle = coordinator.start(seg.source("job", 2))
    [running] = coordinator.in_progress()
    assert running.state is SnapshotState.PERSISTING and running.bytes_persisted < running.bytes_total
    assert asyncio.run(coordinator.wait_status("job/step-2", 0, wait_s=20)).state is SnapshotState.DURABLE
    assert coordinator.in_progress() == []
    # A new coordinator (a restarted server) answers from the manifest on disk.
    later = make_coordinator(tmp_path / "snapshots")
    status = asyncio.run(later.wait_status("job/step-2", 0))
    assert status.state is SnapshotState.DURABLE and status.bytes_total == handle.status().bytes_total
