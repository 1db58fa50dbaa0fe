"""torchtitan glue: the ``build_optimizers`` wrapper that builds a swap container on request.

Importing this module patches nothing. :func:`install_build_optimizers_wrapper` makes
``torchtitan.components.optimizer.build_optimizers`` the wrapper; two modules call it at
import: :mod:`swap_state.client.swap_optimizer` (the seed's tests expect that) and the
custom config module :mod:`swap_state.client.torchtitan_config`, which then also calls
:func:`rebind_imported_model_specs`.

The wrapper reads ``SwapOptimizersContainer`` and ``_original_build_optimizers`` from the
facade at call time (:mod:`swap_state.client.patch_points`), so the seed's patches of those
names take effect.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torchtitan.components.optimizer as _tt_optimizer
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from swap_state.client.patch_points import facade_attr
from swap_state.client.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.swap_container import SwapOptimizersContainer

__all__ = [
    "build_optimizers",
    "install_build_optimizers_wrapper",
    "original_build_optimizers",
    "rebind_imported_model_specs",
]

_SWAP_OPTIMIZER_CLASSES: dict[str, type[Optimizer]] = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}
_WRAPPED_ORIGINAL_ATTR = "__swap_state_original__"


def build_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: Any,
    parallel_dims: Any,
    ft_manager: Any = None,
) -> OptimizersContainer:
    """torchtitan's ``build_optimizers`` plus ``optimizer_config.swap_optimizer``.

    Without ``swap_optimizer`` (or with it False) this is torchtitan's function. With it:
    ``name`` must be ``Adam`` or ``AdamW``; ``swap_optimizer_times`` (default 16) sets the
    slice count; ``swap_optimizer_backend = "remote"`` builds a
    :class:`~swap_state.client.remote_container.RemoteSwapOptimizersContainer` (settings in
    :mod:`swap_state.client.torchtitan_config`); optimizers-in-backward and TorchFT are not
    supported.
    """
    if not getattr(optimizer_config, "swap_optimizer", False):
        original = facade_attr("_original_build_optimizers", original_build_optimizers)
        return original(model_parts, optimizer_config, parallel_dims, ft_manager)
    name = optimizer_config.name
    optimizer_cls = _SWAP_OPTIMIZER_CLASSES.get(name)
    if optimizer_cls is None:
        raise NotImplementedError(f"Optimizer {name} not added.")
    if getattr(optimizer_config, "early_step_in_backward", False):
        raise NotImplementedError("swap_optimizer does not support early_step_in_backward")
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise NotImplementedError("swap_optimizer does not support TorchFT")
    optimizer_kwargs = _optimizer_kwargs(optimizer_config)
    swap_times = int(getattr(optimizer_config, "swap_optimizer_times", DEFAULT_SWAP_TIMES))
    backend = getattr(optimizer_config, "swap_optimizer_backend", "local")
    if backend == "remote":
        from swap_state.client.torchtitan_config import build_remote_container

        return build_remote_container(model_parts, optimizer_cls, optimizer_kwargs, swap_times, optimizer_config)
    if backend != "local":
        raise ValueError(f"optimizer.swap_optimizer_backend must be 'local' or 'remote', got {backend!r}")
    container_cls = facade_attr("SwapOptimizersContainer", SwapOptimizersContainer)
    return container_cls(model_parts, optimizer_cls, optimizer_kwargs, swap_times)


def _optimizer_kwargs(optimizer_config: Any) -> dict[str, Any]:
    """The torch optimizer's keyword arguments from torchtitan's ``[optimizer]`` section."""
    implementation = getattr(optimizer_config, "implementation", "fused")
    return {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": implementation == "fused",
        "foreach": implementation == "foreach",
    }


# torchtitan's own function, also when a wrapper was installed before this module was
# (re)imported: a wrapper is never wrapped again.
original_build_optimizers: Callable[..., OptimizersContainer] = getattr(
    _tt_optimizer.build_optimizers, _WRAPPED_ORIGINAL_ATTR, _tt_optimizer.build_optimizers
)
setattr(build_optimizers, _WRAPPED_ORIGINAL_ATTR, original_build_optimizers)


def install_build_optimizers_wrapper() -> None:
    """Make ``torchtitan.components.optimizer.build_optimizers`` this module's wrapper.

    Idempotent: a wrapper already installed (also by an earlier import of this module) is
    replaced, never wrapped again. Call it before ``torchtitan.models`` is imported: its
    TrainSpecs keep the function they saw at import (else see
    :func:`rebind_imported_model_specs`).
    """
    _tt_optimizer.build_optimizers = build_optimizers


def rebind_imported_model_specs() -> None:
    """Model packages imported before the wrapper captured the unwrapped builder: rebind."""
    original = facade_attr("_original_build_optimizers", original_build_optimizers)
    wrapped = _tt_optimizer.build_optimizers
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.") and getattr(module, "build_optimizers", None) is original:
            module.build_optimizers = wrapped
