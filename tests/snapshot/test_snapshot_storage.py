"""The storage seam's local implementation on its own: files are written and fsynced, the
partial snapshot is published by one rename after its directory is fsynced, nothing partial
is ever listed, and a committed file reads back by range."""

from __future__ import annotations

import os
import pathlib

import pytest

from swap_state.common.snapshot_errors import SnapshotExists
from swap_state.common.snapshot_format import INDEX_NAME, LATEST_NAME, FileRecord, SnapshotIndex, dumps_json
from swap_state.server.snapshot.storage import SnapshotStorage
from swap_state.server.snapshot.storage import StepState, pwrite_all

DATA = "rank-00000.safetensors"


def _index(step: int) -> bytes:
    index = SnapshotIndex(job_id="job", step=step, world_size=1, ranks=(0,),
                          files=(FileRecord(DATA, 0, 10, 0),), created_unix=0.0)
    return dumps_json(index.to_json())


def _write_partial(storage: SnapshotStorage, step: int) -> pathlib.PurePath:
    partial = storage.open_partial("job", step)
    with storage.create_file(partial, DATA) as file:
        file.pwrite(b"hello", 0)
        pwrite_all(file.fileno(), memoryview(b"world"), 5)  # the writer's zero-copy path
        file.fsync()
    storage.write_durable(partial, INDEX_NAME, _index(step))
    return partial


def test_write_fsync_seal_commit_by_rename_and_nothing_partial_listed(tmp_path, monkeypatch):
    storage = SnapshotStorage(tmp_path / "snapshots")
    storage.create_root()
    assert storage.hold()  # alone on the directory
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

    assert storage.step_state("job", 3) is StepState.ABSENT
    partial = _write_partial(storage, 3)
    assert storage.list("job") == []  # an index in a partial snapshot does not make it listed
    storage.seal(partial)
    published = storage.commit(partial, "job", 3, replace=False)
    storage.set_latest("job", 3)
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
    assert published.replaced is None and published.warnings == ()
    assert storage.list("job") == [(3, published.path)]
    assert storage.step_state("job", 3) is StepState.COMPLETE
    assert (storage.location("job") / LATEST_NAME).read_text() == "step-000000000003\n"
    assert (published.path / DATA).read_bytes() == b"helloworld"

    # The step again: refused, or the old one moved aside (unlisted) and discarded.
    again = _write_partial(storage, 3)
    with pytest.raises(SnapshotExists):
        storage.commit(again, "job", 3, replace=False)
    replaced = storage.commit(again, "job", 3, replace=True)
    assert replaced.replaced is not None and storage.list("job") == [(3, replaced.path)]
    assert storage.discard(replaced.replaced)

    # Retention's removal; a failed snapshot's partial is discarded, never listed.
    storage.remove(replaced.path)
    failed = _write_partial(storage, 4)
    assert storage.list("job") == [] and storage.discard(failed)
    assert sorted(p.name for p in pathlib.Path(storage.location("job")).iterdir()) == [LATEST_NAME]
    storage.release()


def test_locations_outside_the_root_are_refused(tmp_path):
    storage = SnapshotStorage(tmp_path / "snapshots")
    storage.create_root()
    with pytest.raises(ValueError, match="not inside"):
        storage.create_file(tmp_path, "x")
    with pytest.raises(ValueError, match="not inside"):
        storage.discard(tmp_path)
