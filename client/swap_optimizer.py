"""The seed's module (torchtitan 0.2): everything here exists because the seed's tests build
containers with ``__new__`` and patch ``param_to_cpu_states_map``, ``get_torch_device``,
``wrap_like_param``, ``SwapOptimizersContainer`` and ``_original_build_optimizers`` here, where
the code reads them at call time. Importing it wraps torchtitan's ``build_optimizers``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from swap_state.client.device import DeviceBackend, get_device_backend
from swap_state.client.optim import container as _container
from swap_state.client.optim import flat_state_dict as _flat
from swap_state.client.optim.dtensor_utils import (  # noqa: F401 (the seed's names)
    DTensor, unwrap_dtensor, wrap_like_param, wrap_like_param_without_device_move)
from swap_state.client.optim.host_cache import (  # noqa: F401 (the seed's names)
    MOMENT_KEYS, STEP_DTYPE, STEP_KEY, HostCacheEntry, fqns_by_param, placeholder_like)
from swap_state.client.optim.moment_store import PinnedHostMemory
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.torchtitan import glue as _glue

__all__ = [
    "DEFAULT_SWAP_TIMES", "MOMENT_KEYS", "STEP_DTYPE", "STEP_KEY", "DTensor", "HostCacheEntry",
    "SwapOptimizersContainer", "build_optimizers", "get_torch_device", "install_build_optimizers_wrapper",
    "unwrap_dtensor", "wrap_like_param", "wrap_like_param_without_device_move"]

#: The process's device backend (``empty_cache``, ``current_device``, streams, ...).
get_torch_device: Callable[[], DeviceBackend] = get_device_backend


class SwapOptimizersContainer(_container.SwapOptimizersContainer):
    """The in-process container as the seed's tests use it: built with ``__new__`` (its parts built on
    first use, the maps patched on the class), its state-dict helpers called on the class."""

    param_to_cpu_states_map: dict[torch.Tensor, dict[str, Any]] = {}  # noqa: RUF012
    param_to_device_states_map: dict[torch.Tensor, dict[str, Any]] = {}  # noqa: RUF012
    swap_optimizer_times = DEFAULT_SWAP_TIMES
    moment_dtype = None
    unswapped = _container.UnswappedOptimizers()
    _loading_keys = None
    _in_container_step = False

    def __getattr__(self, name: str) -> Any:
        if name not in ("store", "_host_caches", "_steps", "_loader"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        backend = get_torch_device()  # this module's: the seed's tests patch it
        self._build_parts(PinnedHostMemory(backend), backend, None)
        return getattr(self, name)

    @classmethod
    def _state_value_for_state_dict(cls, param: Any, state: Any, key: str) -> Any:
        return _flat.state_value(cls.param_to_cpu_states_map, param, state, key)

    _tensor_for_state_dict = staticmethod(_flat.tensor_for_state_dict)
    _fqns_by_param = staticmethod(fqns_by_param)

    @staticmethod
    def _move_step_to_device(step: Any) -> Any:
        if isinstance(step, torch.Tensor) and step.device.type == "cpu":
            return step.to(get_torch_device().current_device())
        return step

    @staticmethod
    def _clone_loaded_state_for_device_placeholder(param: Any, tensor: torch.Tensor) -> Any:
        return placeholder_like(param, tensor, wrap_like_param)


build_optimizers = _glue.build_optimizers
install_build_optimizers_wrapper = _glue.install_build_optimizers_wrapper
#: torchtitan's own ``build_optimizers`` (the wrapper calls it when ``swap_optimizer`` is off).
_original_build_optimizers = _glue.original_build_optimizers

install_build_optimizers_wrapper()
