"""Durability order, retention, killed writers, disk full, and paths confined to the root."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
from snapshot_kit import Trainer

from swap_state.common.segment import Word
from swap_state.server.snapshot.tiers.seam import StepPlan
from swap_state.server.snapshot.restoring.restore import restore
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.common.snapshot_errors import (
    DiskFullError,
    SnapshotExistsError,
    SnapshotInvalid,
    SnapshotNotFoundError,
)
from swap_state.common.snapshot_format import INDEX_NAME, LATEST_NAME, rank_data_name

TESTKIT_DIR = pathlib.Path(__file__).resolve().parents[1]  # tests/: snapshot_kit, integration


def _snapshot(coordinator, seg, step: int) -> None:
    status = coordinator.start(seg.source("job", step)).wait(20)
    assert status.state is SnapshotState.DURABLE, status.error


def _steps(coordinator) -> list[int]:
    return [info.step for info in coordinator.local.list("job")]


def test_durability_order_and_retention(make_segment, make_coordinator, monkeypatch):
    seg = make_segment()
    seg.fill(1)
    coordinator = make_coordinator(keep_latest=2)
    _snapshot(coordinator, seg, 1)
    _snapshot(coordinator, seg, 2)
    job_dir = coordinator.local.job_dir("job")

    trace: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace, real_rmtree = os.fsync, os.rename, os.replace, shutil.rmtree

    def fsync(fd):
        trace.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        if pathlib.Path(dst).name.startswith(".deleting-"):
            # Retention may only run once the new snapshot is complete and latest names it.
            assert (job_dir / "step-000000000003" / INDEX_NAME).exists()
            assert (job_dir / LATEST_NAME).read_text().strip() == "step-000000000003"
        trace.append(("rename", f"{pathlib.Path(src).name}->{pathlib.Path(dst).name}"))
        return real_rename(src, dst)

    def replace(src, dst):
        trace.append(("replace", f"{pathlib.Path(src).name}->{pathlib.Path(dst).name}"))
        return real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        trace.append(("rmtree", pathlib.Path(path).name))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    _snapshot(coordinator, seg, 3)
    coordinator.handle("job/step-3", 0).thread.join(10)  # the trash goes after durable, in it
    monkeypatch.undo()

    def at(event: tuple[str, str]) -> int:
        return trace.index(event)

    def named(kind: str, prefix: str) -> tuple[str, str]:  # trash names end in a unique suffix
        return next(e for e in trace if e[0] == kind and e[1].startswith(prefix))

    partial = job_dir / ".partial-step-000000000003"
    data = at(("fsync", str(partial / rank_data_name(0))))
    manifest = at(("fsync", str(partial / "rank-00000.manifest.json")))
    index = at(("fsync", str(partial / INDEX_NAME)))
    partial_dir = at(("fsync", str(partial)))
    publish = at(("rename", ".partial-step-000000000003->step-000000000003"))
    parent = trace.index(("fsync", str(job_dir)), publish)
    latest = at(("replace", ".latest.tmp->latest"))
    unlisted = named("rename", "step-000000000001->.deleting-step-000000000001.")
    trash = at(unlisted)
    delete = at(("rmtree", unlisted[1].split("->")[1]))
    assert data < manifest < index < partial_dir < publish < parent < latest < trash < delete
    assert _steps(coordinator) == [2, 3]
    assert [i.step for i in coordinator.local.list("job") if i.latest] == [3]
    _snapshot(coordinator, seg, 4)
    assert _steps(coordinator) == [3, 4]


def test_retention_keep_three_and_keep_all(make_segment, make_coordinator, tmp_path):
    seg = make_segment()
    seg.fill(2)
    keep3 = make_coordinator(tmp_path / "k3", keep_latest=3)
    keep_all = make_coordinator(tmp_path / "all", keep_latest=None)
    for step in range(1, 6):
        _snapshot(keep3, seg, step)
        _snapshot(keep_all, seg, step)
    assert _steps(keep3) == [3, 4, 5]
    assert _steps(keep_all) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=">= 2"):
        make_coordinator(tmp_path / "k1", keep_latest=1)
    # A retried RPC gets its durable handle back; a restarted server refuses to redo the step.
    assert keep3.start(seg.source("job", 5)).status().state is SnapshotState.DURABLE
    with pytest.raises(SnapshotExistsError):
        make_coordinator(tmp_path / "k3").start(seg.source("job", 5))
    assert seg.header[Word.SNAP_EPOCH] == 0


def test_the_job_retention_raises_the_floor_and_a_missing_step_says_why(make_segment, make_coordinator):
    seg = make_segment()
    seg.fill(2)
    coordinator = make_coordinator(keep_latest=2)
    for step in range(1, 6):
        coordinator.start(seg.source("job", step, keep_latest=4)).wait(20)
    assert _steps(coordinator) == [2, 3, 4, 5]
    # Asking for less than the server's floor keeps the floor; keep_all removes nothing.
    for step in range(6, 8):
        coordinator.start(seg.source("job", step, keep_latest=1)).wait(20)
    assert _steps(coordinator) == [6, 7]
    for step in range(8, 11):
        coordinator.start(seg.source("job", step, keep_all=True)).wait(20)
    assert _steps(coordinator) == [6, 7, 8, 9, 10]
    with pytest.raises(SnapshotNotFoundError, match="retention removed it.*keep_latest_k"):
        coordinator.local.resolve("job/step-3")
    with pytest.raises(SnapshotNotFoundError, match=r"steps \[6, 7, 8, 9, 10\].*another --snapshot-dir"):
        coordinator.local.resolve("job/step-99")
    with pytest.raises(SnapshotNotFoundError, match="another --snapshot-dir"):
        coordinator.local.resolve("other/latest")


def test_latest_pointer_and_its_fallback(make_segment, make_coordinator):
    seg = make_segment()
    seg.fill(3)
    coordinator = make_coordinator(keep_latest=None)
    store = coordinator.local
    with pytest.raises(SnapshotNotFoundError):
        store.resolve("latest", job_id="job")
    _snapshot(coordinator, seg, 20)
    _snapshot(coordinator, seg, 10)  # e.g. after rolling back: latest is the last taken
    assert store.resolve("latest", job_id="job").step == 10
    assert store.resolve("job/latest").step == 10
    assert store.resolve("job/step-20").step == 20
    assert store.resolve("job/step-000000000020").step == 20
    (store.job_dir("job") / LATEST_NAME).unlink()
    assert store.resolve("job/latest").step == 20  # no pointer: the highest step


_KILLED_WRITER = """
import pathlib, sys, time
from snapshot_kit import Segment
from swap_state.server.snapshot.writing import sink
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.snapshot.coordinator import SnapshotCoordinator
sink.BOUNCE_BYTES = 4096  # O_DIRECT writes page by page: the file grows as it streams
seg = Segment(pathlib.Path(sys.argv[1]))
seg.fill(99)
coordinator = SnapshotCoordinator(sys.argv[2], copy_policy=CopyBudgetPolicy(max_bandwidth=20_000))
coordinator.start(seg.source("job", 2))
print("consistent", flush=True)
time.sleep(60)
"""


def test_killed_writer_leaves_nothing_listed_and_previous_loads(make_segment, make_coordinator, tmp_path):
    seg = make_segment()
    at_step_1 = seg.fill(1)
    snapshots = tmp_path / "snapshots"
    first = make_coordinator(snapshots)
    _snapshot(first, seg, 1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTKIT_DIR), os.environ.get("PYTHONPATH", "")]))
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "other.shm"), str(snapshots)],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert writer.stdout.readline().strip() == b"consistent"
        partial_file = snapshots / "job" / ".partial-step-000000000002" / rank_data_name(0)
        deadline = time.monotonic() + 10
        while not (partial_file.exists() and partial_file.stat().st_size > 8192):
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.02)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    # A directory that merely looks like a snapshot (no snapshot.json) is no snapshot either.
    shutil.copytree(snapshots / "job" / "step-000000000001", snapshots / "job" / "step-000000000005")
    (snapshots / "job" / "step-000000000005" / INDEX_NAME).unlink()

    reader = make_coordinator(snapshots, clean_stale=False)
    assert _steps(reader) == [1]
    with pytest.raises(SnapshotNotFoundError):
        reader.local.resolve("job/step-2")
    with pytest.raises(SnapshotNotFoundError):
        reader.local.resolve("job/step-5")
    target = make_segment("target")
    result = restore(reader.local, "latest", target.mm, target.layout,
                     header=target.header, job_id="job", rank=0, world_size=1)
    assert result.step == 1 and target.tensors() == at_step_1
    # A restarted server removes the killed writer's leftovers (once no other server is live).
    assert (snapshots / "job" / ".partial-step-000000000002").exists()
    first.close()
    reader.close()
    make_coordinator(snapshots)
    assert not (snapshots / "job" / ".partial-step-000000000002").exists()
    assert _steps(reader) == [1]


def test_disk_full_fails_clearly_and_leaves_the_segment_alone(make_segment, make_coordinator, small_tmpfs):
    coordinator = make_coordinator(small_tmpfs)
    small = make_segment("small")
    small.fill(4)
    _snapshot(coordinator, small, 1)  # ~100 KiB: fits into the 1 MiB tmpfs

    big = make_segment("big", specs=[("big.exp_avg", "float32", (512, 1024))], cow_slots=2)
    big.fill(5)
    before = big.tensor_area()
    handle = coordinator.start(big.source("job", 2))
    status = handle.wait(20)
    assert status.state is SnapshotState.FAILED
    assert isinstance(handle.exception, DiskFullError)
    assert str(small_tmpfs) in status.error and "full" in status.error
    assert big.tensor_area() == before
    assert big.header[Word.SNAP_EPOCH] == 0 and big.slots_all_free()
    assert _steps(coordinator) == [1]
    assert coordinator.local.resolve("job/latest").step == 1
    assert sorted(p.name for p in (small_tmpfs / "job").iterdir()) == [LATEST_NAME, "step-000000000001"]

    # Training goes on: a trainer held up by the (slowed) failing snapshot is released by it.
    slow = make_coordinator(small_tmpfs, max_bandwidth=3_000_000)
    handle = slow.start(big.source("job", 2))
    trainer = Trainer(big, first_step=3, n_steps=3)
    trainer.start()
    status = handle.wait(20)
    assert status.state is SnapshotState.FAILED and "is full" in status.error
    assert status.backpressure_waits > 0
    trainer.join(20)
    assert trainer.error is None and big.tensors() == trainer.expected_final()
    assert big.header[Word.SNAP_EPOCH] == 0 and big.slots_all_free()
    assert _steps(coordinator) == [1]


@pytest.mark.parametrize("job_id", ["..", ".", "../x", "a/b", ".hidden", "", "x" * 129])
def test_job_ids_that_would_escape_are_refused(make_segment, make_coordinator, job_id):
    seg = make_segment()
    coordinator = make_coordinator()
    with pytest.raises(SnapshotInvalid):
        coordinator.start(seg.source(job_id, 1))
    with pytest.raises(SnapshotInvalid):
        coordinator.local.job_dir(job_id)
    assert seg.header[Word.SNAP_EPOCH] == 0


def test_symlinked_job_dir_is_refused(make_coordinator, make_segment, tmp_path):
    coordinator = make_coordinator()
    outside = tmp_path / "outside"
    outside.mkdir()
    (coordinator.local.root / "job").symlink_to(outside)
    seg = make_segment()
    with pytest.raises(SnapshotInvalid, match="outside"):
        coordinator.start(seg.source("job", 1))
    assert list(outside.iterdir()) == []
    with pytest.raises(SnapshotInvalid):
        coordinator.local.resolve("../../outside/step-1")


def test_a_second_live_server_on_the_directory_leaves_its_partials_alone(make_coordinator, tmp_path):
    root = tmp_path / "shared"
    first = make_coordinator(root)
    plan = StepPlan("job", 7, 1, (0,), "", None)
    partial = pathlib.Path(first.directory.prepare(plan).location)  # a snapshot the first server is writing
    second = make_coordinator(root)  # e.g. a second embedded server on the per-user default
    assert partial.is_dir()
    first.close()
    second.close()
    make_coordinator(root)  # alone again: what the others left behind is stale now
    assert not partial.exists()


def test_a_retrained_step_is_refused_or_replaced_never_answered_with_old_bytes(make_segment, make_coordinator):
    seg = make_segment()
    seg.fill(1)
    coordinator = make_coordinator(keep_latest=None)
    first = coordinator.start(seg.source("job", 3))
    assert first.wait(20).state is SnapshotState.DURABLE
    assert coordinator.start(seg.source("job", 3)) is first  # a retry: nothing committed since
    # The trainer loads an older checkpoint and trains step 3 again: other bytes, a commit.
    retrained = seg.fill(2)
    seg.header[Word.TRAINER_COMMITS] += 1
    with pytest.raises(SnapshotExistsError, match="earlier attempt.*replace_existing"):
        coordinator.start(seg.source("job", 3))
    again = coordinator.start(seg.source("job", 3, replace_existing=True))
    assert again is not first and again.wait(20).state is SnapshotState.DURABLE
    assert _steps(coordinator) == [3]
    target = make_segment("target")
    restore(coordinator.local, "job/step-3", target.mm, target.layout,
            header=target.header, job_id="job", rank=0, world_size=1)
    assert target.tensors() == retrained
    # A restarted server (nothing in memory) decides the same from the disk.
    coordinator.close()
    restarted = make_coordinator(coordinator.local.root, keep_latest=None)
    with pytest.raises(SnapshotExistsError, match="earlier attempt"):
        restarted.start(seg.source("job", 3))
    assert restarted.start(seg.source("job", 3, replace_existing=True)).wait(20).state is SnapshotState.DURABLE


def test_another_run_reaching_a_durable_step_writes_its_own_bytes_or_is_refused(make_segment, make_coordinator):
    """A job id run again from scratch commits as many steps as the first run did: only the
    session and generation tell the runs apart. Never "durable" over the first run's files."""
    coordinator = make_coordinator(keep_latest=None)
    first_run = make_segment("first")
    first_run.fill(1)
    first_run.header[Word.TRAINER_COMMITS] = 3
    first = coordinator.start(first_run.source("job", 3, session_id="a" * 32, generation=1))
    assert first.wait(20).state is SnapshotState.DURABLE
    assert coordinator.start(first_run.source("job", 3, session_id="a" * 32, generation=1)) is first

    second_run = make_segment("second")
    mine = second_run.fill(2)
    second_run.header[Word.TRAINER_COMMITS] = 3  # the same count of commits as the first run
    with pytest.raises(SnapshotExistsError, match="earlier attempt"):
        coordinator.start(second_run.source("job", 3, session_id="b" * 32, generation=1))
    # The same session reattached (a new generation) is another run too.
    with pytest.raises(SnapshotExistsError):
        coordinator.start(first_run.source("job", 3, session_id="a" * 32, generation=2))
    again = coordinator.start(second_run.source("job", 3, session_id="b" * 32, generation=1,
                                                replace_existing=True))
    assert again is not first and again.wait(20).state is SnapshotState.DURABLE
    target = make_segment("target")
    restore(coordinator.local, "job/step-3", target.mm, target.layout,
            header=target.header, job_id="job", rank=0, world_size=1)
    assert target.tensors() == mine


def test_a_job_resumed_at_another_world_size_replaces_a_step_its_earlier_size_took(make_segment, make_coordinator):
    coordinator = make_coordinator(keep_latest=None)
    ranks = [make_segment(f"rank{r}") for r in range(2)]
    for r, seg in enumerate(ranks):
        seg.fill(10 + r)
    handles = [coordinator.start(seg.source("job", 6, rank=r, world_size=2, session_id=f"{r}" * 32))
               for r, seg in enumerate(ranks)]
    assert [h.wait(20).state for h in handles] == [SnapshotState.DURABLE] * 2

    alone = make_segment("alone")
    mine = alone.fill(3)
    with pytest.raises(SnapshotExistsError):
        coordinator.start(alone.source("job", 6, world_size=1, session_id="c" * 32))
    replaced = coordinator.start(alone.source("job", 6, world_size=1, session_id="c" * 32, replace_existing=True))
    assert replaced.wait(20).state is SnapshotState.DURABLE
    info = coordinator.local.resolve("job/step-6")
    assert (info.world_size, info.ranks) == (1, (0,))
    target = make_segment("target")
    restore(coordinator.local, "job/step-6", target.mm, target.layout,
            header=target.header, job_id="job", rank=0, world_size=1)
    assert target.tensors() == mine


def test_snapshot_files_and_directories_are_the_server_users_alone_whatever_the_umask(make_segment, make_coordinator):
    old = os.umask(0)
    try:
        seg = make_segment()
        seg.fill(4)
        coordinator = make_coordinator()
        _snapshot(coordinator, seg, 1)
    finally:
        os.umask(old)
    root = coordinator.local.root
    job_dir = coordinator.local.job_dir("job")
    assert stat.S_IMODE(os.stat(root / ".swap-state.lock").st_mode) == 0o600
    for directory, dirs, files in os.walk(job_dir):
        for name in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o700, name
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(job_dir).st_mode) == 0o700
