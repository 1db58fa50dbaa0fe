"""What the parts of a swap container read of the container that holds them.

The container (:class:`~swap_state.client.optim.container.SwapOptimizersContainer`) owns the
torch optimizers, the model parts and the two maps, and carries the hooks a subclass overrides
(the remote container does). Its parts (host caches, step pipeline, state loader) are objects
of their own that it builds and holds; each is handed the container typed as this interface,
so what a part may touch is written here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.optim import Optimizer

    from swap_state.client.device import DeviceBackend

__all__ = ["SwapContainer"]


class SwapContainer(Protocol):
    """The state and hooks of a swap container its parts use."""

    model_parts: list[nn.Module]
    optimizers: list[Optimizer]
    param_to_cpu_states_map: dict[torch.Tensor, dict[str, Any]]  # host_cache.HostCache per parameter
    param_to_device_states_map: dict[torch.Tensor, dict[str, Any]]
    swap_optimizer_times: int
    moment_dtype: torch.dtype | None  # None: each parameter's dtype

    @property
    def device_backend(self) -> DeviceBackend: ...

    # hooks (call order in the container's docstring)
    def _allocate_host_cache(self, entries: Sequence[Any]) -> dict[torch.Tensor, dict[str, torch.Tensor]]: ...  # HostCacheEntry
    def _before_host_write(self, params: Sequence[torch.Tensor]) -> None: ...
    def _after_step(self) -> None: ...
    def _after_load_state_dict(self) -> None: ...
