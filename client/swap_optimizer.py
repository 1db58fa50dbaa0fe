"""In-process swap optimizer for torchtitan 0.2.x: Adam moments live in host memory.

This is the seed's module (its tests import it as
``torchtitan_npu.patches.optimizer.swap_optimizer``): a facade over the modules that do the
work. :class:`SwapOptimizersContainer` keeps ``exp_avg``, ``exp_avg_sq`` (and
``max_exp_avg_sq`` with amsgrad) plus a per-parameter ``step`` in a *host cache* (pinned where
an accelerator exists); ``optimizer.state`` only holds zero-storage placeholders. ``step()``
streams the moments through the accelerator in ``swap_optimizer_times`` slices.

The modules behind it:

- :mod:`~swap_state.client.optim.container`: the container: construction, subclass hooks
- :mod:`~swap_state.client.optim.host_cache`: host cache layout, allocation checks, placeholders
- :mod:`~swap_state.client.optim.step_pipeline`: ``step()``: load -> fused update -> offload
- :mod:`~swap_state.client.optim.flat_state_dict`: ``state_dict()``, parameter FQNs, flat keys
- :mod:`~swap_state.client.optim.state_loading`: ``load_state_dict()``: plan, commit, rollback
- :mod:`~swap_state.client.optim.dtensor_utils`: DTensor unwrap / wrap
- :mod:`~swap_state.client.torchtitan.glue`: the ``build_optimizers`` wrapper

Importing this module wraps ``torchtitan.components.optimizer.build_optimizers``:
``optimizer_config.swap_optimizer = True`` builds a :class:`SwapOptimizersContainer`,
anything else goes to torchtitan's own function. ``torch.optim.Adam.step`` /
``AdamW.step`` are never patched: only the container's own optimizers step through the
swap pipeline (each gets a bound ``step``).

The seed's tests patch ``get_torch_device``, ``unwrap_dtensor``, ``wrap_like_param``,
``SwapOptimizersContainer`` and ``_original_build_optimizers`` here and expect the container
and the wrapper to see the patch. Each of these names is the very object of the module that
uses it (``get_torch_device`` is :func:`swap_state.client.device.get_device_backend`), and
setting one here sets it there too (:class:`_SeedFacade`): the code calls its own module's
attribute, with no lookup of this module on the way.

Checkpoints are a flat dict (``state.<fqn>.<key>``, ``param_groups.<fqn>.<hyperparameter>``)
read from the host cache; tied parameters are saved once under their canonical name and
load from any alias. See ``../shared/seed/`` for the behavioural spec.
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
    DTensor,
    unwrap_dtensor,
    wrap_like_param,
    wrap_like_param_without_device_move,
)
from swap_state.client.optim.host_cache import MOMENT_KEYS, STEP_DTYPE, STEP_KEY, HostCache, HostCacheEntry  # noqa: F401 (HostCache: kept importable here)
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.optim.container import SwapOptimizersContainer

__all__ = [
    "DEFAULT_SWAP_TIMES",
    "MOMENT_KEYS",
    "STEP_DTYPE",
    "STEP_KEY",
    "DTensor",
    "HostCacheEntry",
    "SwapOptimizersContainer",
    "build_optimizers",
    "get_torch_device",
    "install_build_optimizers_wrapper",
    "unwrap_dtensor",
    "wrap_like_param",
    "wrap_like_param_without_device_move",
]


#: The process's device backend (``empty_cache``, ``current_device``, streams, ...).
get_torch_device: Callable[[], DeviceBackend] = get_device_backend

build_optimizers = _glue.build_optimizers
install_build_optimizers_wrapper = _glue.install_build_optimizers_wrapper
#: torchtitan's own ``build_optimizers``; the wrapper calls it (looked up here) when
#: ``swap_optimizer`` is off.
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
