"""Fixtures for the snapshot tests: segments, coordinators, a tiny tmpfs (all torn down)."""

from __future__ import annotations

import pytest
from snapshot_kit import Segment, tiny_tmpfs

from swap_state.common.server_config import SnapshotSettings
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.snapshot.coordinator import SnapshotCoordinator


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

    def make(snapshot_dir=None, max_bandwidth=None, **kwargs) -> SnapshotCoordinator:
        """``max_bandwidth``: the cap on snapshot I/O, as ``--persist-max-bandwidth`` gives it."""
        if max_bandwidth is not None:
            kwargs["copy_policy"] = CopyBudgetPolicy(max_bandwidth=max_bandwidth)
        settings = SnapshotSettings(**{name: kwargs.pop(name) for name in SnapshotSettings.__dataclass_fields__
                                       if name in kwargs})
        coordinator = SnapshotCoordinator(snapshot_dir or tmp_path / "snapshots", settings, **kwargs)
        made.append(coordinator)
        return coordinator

    yield make
    for coordinator in made:
        coordinator.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted in the test's temp dir (needs root / CAP_SYS_ADMIN)."""
    with tiny_tmpfs(tmp_path / "tmpfs", "1M") as mount_point:
        yield mount_point
