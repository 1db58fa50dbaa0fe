"""The names the seed's tests patch on the facade, looked up there at call time.

The seed's tests monkeypatch ``get_torch_device``, ``wrap_like_param``,
``SwapOptimizersContainer`` and ``_original_build_optimizers`` on
:mod:`swap_state.client.swap_optimizer` (the facade) and expect the container and the
``build_optimizers`` wrapper to see the patch. The job modules therefore never bind these
names at import; they call the functions here, which read the facade's attribute on every
call.

When the facade is not imported nothing can have patched it, and the default is used:
importing the facade installs the torchtitan wrapper, which a remote container (or any other
user of the job modules) must not do as a side effect.
"""

from __future__ import annotations

import sys
from typing import Any

from swap_state.client.optim import dtensor_utils
from swap_state.client.device import DeviceBackend, get_device_backend

__all__ = ["FACADE", "facade_attr", "get_torch_device", "unwrap_dtensor", "wrap_like_param"]

FACADE = "swap_state.client.swap_optimizer"


def facade_attr(name: str, default: Any) -> Any:
    """The facade's ``name`` (patched or not) when the facade is imported, else ``default``."""
    facade = sys.modules.get(FACADE)
    # getattr with a default: while the facade is still being imported, its names may not
    # exist yet.
    return default if facade is None else getattr(facade, name, default)


def get_torch_device() -> DeviceBackend:
    """The facade's ``get_torch_device()``."""
    return facade_attr("get_torch_device", get_device_backend)()


def unwrap_dtensor(tensor: Any) -> Any:
    """The facade's ``unwrap_dtensor(tensor)``."""
    return facade_attr("unwrap_dtensor", dtensor_utils.unwrap_dtensor)(tensor)


def wrap_like_param(local_tensor: Any, like: Any) -> Any:
    """The facade's ``wrap_like_param(local_tensor, like)``."""
    return facade_attr("wrap_like_param", dtensor_utils.wrap_like_param)(local_tensor, like)
