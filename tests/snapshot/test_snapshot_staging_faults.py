"""Faults while the server stages ahead of the trainer keep today's guarantees: nothing torn is
listed, the last durable snapshot restores bitwise, the trainer keeps training."""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from snapshot_kit import Trainer

from swap_state.common.copy_before_write import BackPressureTimeout
from swap_state.common.segment import Word
from swap_state.common.snapshot_errors import DiskFullError, SnapshotNotFoundError
from swap_state.common.snapshot_format import LATEST_NAME
from swap_state.server.snapshot.writing import writer as snapshot_writer
from swap_state.server.snapshot.restoring.restore import restore
from swap_state.server.snapshot.coordinator import SnapshotState

from test_snapshot_consistency import _file_tensors
from test_snapshot_staging import WIDE

HERE = pathlib.Path(__file__).resolve().parent
TESTKIT_DIR = HERE.parent  # tests/: snapshot_kit, integration


def _env() -> dict[str, str]:
    path = [str(TESTKIT_DIR), str(HERE), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _durable(coordinator, seg, step: int) -> None:
    status = coordinator.start(seg.source("job", step)).wait(20)
    assert status.state is SnapshotState.DURABLE, status.error


def _steps(coordinator) -> list[int]:
    return [info.step for info in coordinator.local.list("job")]


_TRAINER = """
import pathlib, sys, time
from snapshot_kit import Segment, Trainer
from test_snapshot_staging import WIDE
from swap_state.common.segment import Word
seg = Segment(pathlib.Path(sys.argv[1]), WIDE, cow_slots=int(sys.argv[2]), attach=True)
print("attached", flush=True)
while seg.header[Word.SNAP_EPOCH] == 0:  # the snapshot begins between steps
    time.sleep(0.001)
Trainer(seg, first_step=100, n_steps=10**6).run()
"""


def test_trainer_killed_while_the_server_stages(make_segment, make_coordinator):
    seg = make_segment(specs=WIDE, cow_slots=6)
    at_step_n = seg.fill(seed=11)
    coordinator = make_coordinator(max_bandwidth=300_000)
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(seg.path), "6"], stdout=subprocess.PIPE, env=_env()
    )
    try:
        assert trainer.stdout.readline().strip() == b"attached"
        handle = coordinator.start(seg.source("job", 5))
        deadline = time.monotonic() + 10
        while seg.header[Word.COW_COPIES] == 0 or seg.header[Word.STAGED_UPTO] == 0:
            assert time.monotonic() < deadline, "neither the trainer nor the stager got going"
            time.sleep(0.005)
    finally:
        trainer.send_signal(signal.SIGKILL)  # mid-step: maybe holding a slot it never published
        trainer.wait()
    status = handle.wait(20)
    assert status.state is SnapshotState.DURABLE, status.error
    assert _file_tensors(status.path + "/rank-00000.safetensors") == at_step_n
    assert seg.header[Word.SNAP_EPOCH] == 0 and seg.slots_all_free()
    # A restarted trainer (it finds the segment torn when WRITING_STEP is set) trains on.
    seg.header[Word.WRITING_STEP] = 0
    handle = coordinator.start(seg.source("job", 6))
    again = Trainer(seg, first_step=200, n_steps=3)
    again.start()
    assert handle.wait(20).state is SnapshotState.DURABLE
    again.join(20)
    assert again.error is None and seg.tensors() == again.expected_final()


_SERVER = """
import pathlib, sys, time
from snapshot_kit import Segment
from test_snapshot_staging import WIDE
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.snapshot.coordinator import SnapshotCoordinator
seg = Segment(pathlib.Path(sys.argv[1]), WIDE, cow_slots=96, attach=True)
coordinator = SnapshotCoordinator(sys.argv[2], copy_policy=CopyBudgetPolicy(max_bandwidth=20_000),
                                  clean_stale=False)
coordinator.start(seg.source("job", 2))
print("consistent", flush=True)
time.sleep(60)
"""


def test_server_killed_while_staging(make_segment, make_coordinator, tmp_path):
    seg = make_segment(specs=WIDE, cow_slots=96)
    at_step_1 = seg.fill(seed=12)
    snapshots = tmp_path / "snapshots"
    first = make_coordinator(snapshots)
    _durable(first, seg, 1)
    first.close()  # that server is gone; the one started below is killed
    seg.fill(seed=13)  # step 2's bytes
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(seg.path), str(snapshots)], stdout=subprocess.PIPE, env=_env()
    )
    try:
        assert server.stdout.readline().strip() == b"consistent"
        deadline = time.monotonic() + 10
        while seg.header[Word.STAGED_UPTO] < 10:
            assert time.monotonic() < deadline, "the stager never got going"
            time.sleep(0.005)
        assert seg.header[Word.PERSISTED_UPTO] < seg.layout.n_chunks
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    # Nothing torn is listed; a restarted server removes the partial.
    reader = make_coordinator(snapshots, clean_stale=False)
    assert _steps(reader) == [1]
    with pytest.raises(SnapshotNotFoundError):
        reader.local.resolve("job/step-2")
    # On the dead server's segment the staged chunks need no copy; past them the trainer
    # copies into its own few slots, then gives up within its bound instead of hanging.
    staged = seg.header[Word.STAGED_UPTO]
    stuck = Trainer(seg, first_step=3, n_steps=1, max_wait_s=0.2)
    stuck.run()
    assert all(seg.header.cow_epoch(c) == 0 for c in range(staged))
    assert stuck.error is None or isinstance(stuck.error, BackPressureTimeout)
    # A trainer that knows its server is gone (its KeepAlive broke) never waits: it gives the
    # dead epoch up (protocol step 6) and writes at once.
    epoch = seg.header[Word.SNAP_EPOCH]
    on_its_own = Trainer(seg, first_step=4, n_steps=2, max_wait_s=0.2, server_gone=lambda: True)
    on_its_own.run()
    assert on_its_own.error is None and seg.tensors() == on_its_own.expected_final()
    if stuck.error is not None:  # it ran out of slots: the next one gave the epoch up
        assert seg.header[Word.ABANDONED_EPOCH] == epoch != 0
    # The trainer trains on from the last durable snapshot, restored bitwise into a new segment.
    fresh = make_segment("fresh", specs=WIDE, cow_slots=96)
    reader.close()
    restarted = make_coordinator(snapshots)
    result = restore(restarted.local, "latest", fresh.mm, fresh.layout,
                     header=fresh.header, job_id="job", rank=0, world_size=1)
    assert result.step == 1 and fresh.tensors() == at_step_1
    assert not (snapshots / "job" / ".partial-step-000000000002").exists()
    handle = restarted.start(fresh.source("job", 2))
    on = Trainer(fresh, first_step=2, n_steps=3)
    on.start()
    status = handle.wait(20)
    on.join(20)
    assert on.error is None and status.state is SnapshotState.DURABLE
    assert _file_tensors(status.path + "/rank-00000.safetensors") == at_step_1
    assert fresh.tensors() == on.expected_final()


def test_snapshot_failing_midway_while_staging(make_segment, make_coordinator, monkeypatch):
    seg = make_segment(specs=WIDE, cow_slots=96)
    seg.fill(seed=14)
    coordinator = make_coordinator(max_bandwidth=1_000_000)
    _durable(coordinator, seg, 1)
    at_step_1 = seg.tensors()
    real_place = snapshot_writer._place
    written = {"n": 0}

    def place(sink, data, stable):
        written["n"] += 1
        if written["n"] > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_place(sink, data, stable)

    monkeypatch.setattr(snapshot_writer, "_place", place)
    handle = coordinator.start(seg.source("job", 2))
    trainer = Trainer(seg, first_step=3, n_steps=4, before_step=lambda step: time.sleep(0.05))
    trainer.start()
    status = handle.wait(20)
    trainer.join(20)
    assert status.state is SnapshotState.FAILED and isinstance(handle.exception, DiskFullError)
    assert status.server_staged_chunks > 0
    assert trainer.error is None and seg.tensors() == trainer.expected_final()
    assert seg.header[Word.SNAP_EPOCH] == 0 and seg.slots_all_free()
    assert _steps(coordinator) == [1]
    assert sorted(p.name for p in coordinator.local.job_dir("job").iterdir()) == [LATEST_NAME, "step-000000000001"]
    monkeypatch.undo()
    target = make_segment("target", specs=WIDE)
    restore(coordinator.local, "latest", target.mm, target.layout,
            header=target.header, job_id="job", rank=0, world_size=1)
    assert target.tensors() == at_step_1


def test_disk_full_while_staging_on_a_tiny_tmpfs(make_segment, make_coordinator, small_tmpfs):
    big = make_segment("big", specs=[("big.exp_avg", "float32", (512, 1024))], cow_slots=512)  # 2 MiB
    big.fill(15)
    before = big.tensor_area()
    slow = make_coordinator(small_tmpfs, max_bandwidth=3_000_000)
    handle = slow.start(big.source("job", 2))
    trainer = Trainer(big, first_step=3, n_steps=3, before_step=lambda step: time.sleep(0.02))
    trainer.start()
    status = handle.wait(20)
    trainer.join(20)
    assert status.state is SnapshotState.FAILED and "full" in status.error
    assert trainer.error is None and big.tensors() == trainer.expected_final() != before
    assert big.header[Word.SNAP_EPOCH] == 0 and big.slots_all_free()
    assert slow.local.list("job") == []
    assert status.server_staged_chunks > 0


def test_a_snapshot_the_trainer_gave_up_fails_and_the_next_one_holds_its_step(make_segment, make_coordinator):
    # A writer slower than the trainer, the trainer's few slots: it would wait, but
    # its server looks gone to it, so it overwrites without a copy. The writer must not list
    # what it read (protocol step 6).
    seg = make_segment(specs=WIDE, cow_slots=4)
    seg.fill(seed=15)
    coordinator = make_coordinator(max_bandwidth=200_000)
    handle = coordinator.start(seg.source("job", 2))
    trainer = Trainer(seg, first_step=3, n_steps=2, max_wait_s=5.0, server_gone=lambda: True)
    trainer.start()
    status = handle.wait(60)
    trainer.join(20)
    assert trainer.error is None and seg.tensors() == trainer.expected_final()
    assert status.state is SnapshotState.FAILED and "gave this snapshot up" in status.error
    assert _steps(coordinator) == [] and seg.header[Word.SNAP_EPOCH] == 0
    at_step_4 = seg.tensors()
    handle = coordinator.start(seg.source("job", 4))  # a new epoch, above the abandoned one
    assert handle.wait(60).state is SnapshotState.DURABLE
    target = make_segment("target", specs=WIDE)
    restore(coordinator.local, "latest", target.mm, target.layout,
            header=target.header, job_id="job", rank=0, world_size=1)
    assert target.tensors() == at_step_4
