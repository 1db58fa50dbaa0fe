"""In-process swap optimizer for torchtitan 0.2.x: Adam moments live in host memory.

The seed's module: a facade over :mod:`swap_state.client.optim`. Importing it wraps torchtitan's
``build_optimizers`` (``optimizer_config.swap_optimizer = True`` builds a swap container).

The seed's tests patch ``get_torch_device``, ``unwrap_dtensor``, ``wrap_like_param``,
``SwapOptimizersContainer`` and ``_original_build_optimizers`` here; setting one here sets the
attribute the code calls in its own module too (:class:`_SeedFacade`).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

from swap_state.client.torchtitan import glue as _glue
from swap_state.client.device import DeviceBackend, get_device_backend
from swap_state.client.optim.dtensor_utils import (
    DTensor, unwrap_dtensor, wrap_like_param, wrap_like_param_without_device_move,
)
from swap_state.client.optim.host_cache import MOMENT_KEYS, STEP_DTYPE, STEP_KEY, HostCache, HostCacheEntry  # noqa: F401 (HostCache: kept importable here)
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.optim.container import SwapOptimizersContainer

__all__ = [
    "DEFAULT_SWAP_TIMES", "MOMENT_KEYS", "STEP_DTYPE", "STEP_KEY", "DTensor", "HostCacheEntry",
    "SwapOptimizersContainer", "build_optimizers", "get_torch_device", "install_build_optimizers_wrapper",
    "unwrap_dtensor", "wrap_like_param", "wrap_like_param_without_device_move",
]


#: The process's device backend (``empty_cache``, ``current_device``, streams, ...).
get_torch_device: Callable[[], DeviceBackend] = get_device_backend

build_optimizers = _glue.build_optimizers
install_build_optimizers_wrapper = _glue.install_build_optimizers_wrapper
#: torchtitan's own ``build_optimizers`` (the wrapper calls it when ``swap_optimizer`` is off).
_original_build_optimizers = _glue.original_build_optimizers

install_build_optimizers_wrapper()

#: The names the seed's tests patch here: (module, attribute) the code calls.
_PATCHED_THROUGH: dict[str, tuple[str, str]] = {
    "get_torch_device": ("swap_state.client.device", "get_device_backend"),
    "unwrap_dtensor": ("swap_state.client.optim.dtensor_utils", "unwrap_dtensor"),
    "wrap_like_param": ("swap_state.client.optim.dtensor_utils", "wrap_like_param"),
    "SwapOptimizersContainer": ("swap_state.client.torchtitan.glue", "SwapOptimizersContainer"),
    "_original_build_optimizers": ("swap_state.client.torchtitan.glue", "original_build_optimizers"),
}


class _SeedFacade(types.ModuleType):
    """This module's type: setting one of :data:`_PATCHED_THROUGH`'s names (a test's patch,
    or its undo) also sets the attribute the code calls."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        target = _PATCHED_THROUGH.get(name)
        if target is not None:
            setattr(importlib.import_module(target[0]), target[1], value)


sys.modules[__name__].__class__ = _SeedFacade
