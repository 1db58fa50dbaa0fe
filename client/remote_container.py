"""The public name of the remote container's module; it lives in :mod:`swap_state.client.remote.container`."""

from swap_state.client.remote.container import (
    GROUP_STEPS, PARAM_STEPS, SNAPSHOT_JOB_KEY, SNAPSHOT_REF_KEY, RemoteConfig, RemoteSwapOptimizersContainer,
    SnapshotHandle)

__all__ = [
    "GROUP_STEPS", "PARAM_STEPS", "SNAPSHOT_JOB_KEY", "SNAPSHOT_REF_KEY", "RemoteConfig",
    "RemoteSwapOptimizersContainer", "SnapshotHandle"]
