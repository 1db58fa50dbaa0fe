"""What the parts of the remote container read of the container that holds them.

:class:`~swap_state.client.remote.container.RemoteSwapOptimizersContainer` holds a
:class:`~swap_state.client.remote.reattach.ReattachCheck`, a
:class:`~swap_state.client.remote.snapshots.SnapshotClient` and a
:class:`~swap_state.client.remote.checkpoint.CheckpointMode`. Each is handed the container
typed as :class:`RemoteContainer`: the session and segment it attached, the state the other
parts own (through the container's properties) and the container methods it may call.
Annotations only: nothing here is imported at run time by the parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from swap_state.client.optim.owner import SwapContainer

__all__ = ["RemoteContainer"]


class RemoteContainer(SwapContainer, Protocol):
    """The remote container as its parts see it."""

    # what the container attached and mapped
    session: Any  # rpc.RemoteSession
    client: Any  # rpc.SwapStateClient
    remote_config: Any  # config.RemoteConfig
    _embedded: Any  # embedded.EmbeddedServer | None
    _mapping: Any  # segment_mapping.SegmentMapping | None
    _views: dict[str, Any]  # the segment's tensors by name
    _guard: Any  # snapshot_guard.SnapshotGuard | None
    _model_area: Any  # model_area.ModelArea | None
    _entries: list[Any]  # host_cache.HostCacheEntry, in update order
    _tensor_names: dict[Any, list[str]]
    _load_template: Any  # optim.checkpoint_template.LoadTemplate
    _closed: bool

    # state one part owns, others read (the container's properties)
    resumed_step: int | None  # ReattachCheck
    _torn_step: int | None  # ReattachCheck
    _snapshot_step: int | None  # SnapshotClient
    _snapshot_handle: Any  # SnapshotClient: snapshots.SnapshotHandle | None

    # the container's methods the parts call
    def _publish_step(self, params_known: bool = True) -> int: ...
    def _verify_kept_state(self) -> None: ...
    def _load_group_steps_from_segment(self) -> None: ...
    def snapshot(self) -> Any: ...
    def restore(self, snapshot_id: str = "latest") -> int: ...
    def _snapshot_handle_for(self, snapshot_id: str) -> Any: ...
    def _wait_segment_released(self, why: str) -> None: ...
    def _full_state_dict(self) -> dict[str, Any]: ...
    def _full_load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...
