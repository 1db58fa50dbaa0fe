"""swap-state trainer side: device layer, swap optimizers, the remote container.

``RemoteSwapOptimizersContainer`` and ``SwapOptimizersContainer`` are imported lazily, so
``import swap_state.client.remote.rpc`` (used by the ``swap-state`` CLI) does not import torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# gRPC's fork handlers wait for its threads to be quiescent; one waiting for the GIL the forking
# thread holds never is, so a trainer that forks hangs in fork(). No forked child uses gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__all__ = ["RemoteSwapOptimizersContainer", "RemoteConfig", "SwapOptimizersContainer"]

_LAZY = {
    "RemoteSwapOptimizersContainer": "swap_state.client.remote.container",
    "RemoteConfig": "swap_state.client.remote.container",
    "SwapOptimizersContainer": "swap_state.client.optim.container"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'swap_state.client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
