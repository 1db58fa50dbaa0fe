"""The snapshot directory's writing on its own: files are written and fsynced, the partial
snapshot is published by one rename after its directory is fsynced, nothing partial is ever
listed, a replaced or retired snapshot is unlisted before its bytes go."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest

from swap_state.common.snapshot_errors import SnapshotExistsError
from swap_state.common.snapshot_format import INDEX_NAME, LATEST_NAME, FileRecord, SnapshotIndex
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.seam import StepPlan, StepWrite

DATA = "rank-00000.safetensors"


def _index(step: int) -> SnapshotIndex:
    return SnapshotIndex(job_id="job", step=step, world_size=1, ranks=(0,),
                         files=(FileRecord(DATA, 0, 10, 0),), created_unix=0.0)


def _write_partial(directory: SnapshotDirectory, step: int, replace: bool = False, keep: int | None = None) -> StepWrite:
    partial = directory.prepare(StepPlan("job", step, 1, (0,), "", keep, replace=replace))
    with directory.open_file(partial, DATA) as sink:
        sink.write_all(b"hello")
        sink.write_all(b"world")
        sink.finish()
    return partial


def test_write_fsync_seal_commit_by_rename_and_nothing_partial_listed(tmp_path, monkeypatch):
    directory = SnapshotDirectory(tmp_path / "snapshots")
    directory.create_root()
    assert directory.hold()  # alone on the directory
    trace: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        trace.append(("fsync", pathlib.Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        return real_fsync(fd)

    def rename(src, dst):
        trace.append(("rename", f"{pathlib.Path(src).name}->{pathlib.Path(dst).name}"))
        return real_rename(src, dst)

    def replace(src, dst):
        trace.append(("replace", f"{pathlib.Path(src).name}->{pathlib.Path(dst).name}"))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)

    partial = _write_partial(directory, 3)
    assert directory.reader.list("job") == []  # a partial snapshot is never listed
    committed = directory.finish(partial, _index(3), None)
    monkeypatch.undo()

    assert trace == [
        ("fsync", DATA),
        ("fsync", INDEX_NAME),
        ("fsync", ".partial-step-000000000003"),
        ("rename", ".partial-step-000000000003->step-000000000003"),
        ("fsync", "job"),
        ("fsync", ".latest.tmp"),
        ("replace", ".latest.tmp->latest"),
        ("fsync", "job"),
    ]
    assert committed.trash == () and committed.warnings == ()
    assert [(i.step, i.path) for i in directory.reader.list("job")] == [(3, committed.path)]
    assert (directory.reader.job_dir("job") / LATEST_NAME).read_text() == "step-000000000003\n"
    assert (committed.path / DATA).read_bytes() == b"helloworld"

    # The step again: refused, or the old one moved aside (unlisted) and discarded.
    with pytest.raises(SnapshotExistsError):
        _write_partial(directory, 3)
    refused = _write_partial(directory, 3, replace=True)
    with pytest.raises(SnapshotExistsError):
        directory.finish(dataclasses.replace(refused, plan=dataclasses.replace(refused.plan, replace=False)),
                         _index(3), None)
    assert directory.discard(refused)
    again = _write_partial(directory, 3, replace=True)
    replaced = directory.finish(again, _index(3), None)
    assert len(replaced.trash) == 1 and [i.path for i in directory.reader.list("job")] == [replaced.path]
    assert directory.empty_trash(replaced) == []

    # Retention's removal; a failed snapshot's partial is discarded, never listed.
    retired = directory.finish(_write_partial(directory, 4, keep=1), _index(4), None)
    assert [i.step for i in directory.reader.list("job")] == [4] and directory.empty_trash(retired) == []
    failed = _write_partial(directory, 5)
    assert [i.step for i in directory.reader.list("job")] == [4] and directory.discard(failed)
    assert sorted(p.name for p in directory.reader.job_dir("job").iterdir()) == [LATEST_NAME, "step-000000000004"]
    directory.release()


def test_locations_outside_the_root_are_refused(tmp_path):
    directory = SnapshotDirectory(tmp_path / "snapshots")
    directory.create_root()
    outside = StepWrite(StepPlan("job", 1, 1, (0,), "", None), tmp_path, (0,))
    with pytest.raises(ValueError, match="not inside"):
        directory.open_file(outside, "x")
    with pytest.raises(ValueError, match="not inside"):
        directory.discard(outside)
