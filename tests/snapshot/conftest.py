"""Fixtures for the snapshot tests: segments, coordinators, a tiny tmpfs (all torn down)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from snapshot_testkit import Segment

from swap_state.server.snapshot_coordinator import SnapshotCoordinator


@pytest.fixture
def make_segment(tmp_path):
    made: list[Segment] = []

    def make(name: str = "seg", **kwargs) -> Segment:
        segment = Segment(tmp_path / f"{name}.shm", **kwargs)
        made.append(segment)
        return segment

    yield make
    for segment in made:
        segment.close()


@pytest.fixture
def make_coordinator(tmp_path):
    made: list[SnapshotCoordinator] = []

    def make(snapshot_dir=None, **kwargs) -> SnapshotCoordinator:
        coordinator = SnapshotCoordinator(snapshot_dir or tmp_path / "snapshots", **kwargs)
        made.append(coordinator)
        return coordinator

    yield make
    for coordinator in made:
        coordinator.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted in the test's temp dir (needs root / CAP_SYS_ADMIN)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) binary: cannot create a small tmpfs to fill")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)
