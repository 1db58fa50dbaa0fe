"""torchtitan 0.2 glue: the ``build_optimizers`` wrapper that builds a swap container on request, and the job hooks.
Importing it patches nothing; the wrapper reads ``SwapOptimizersContainer`` and ``_original_build_optimizers`` from
:mod:`swap_state.client.swap_optimizer` at call time (the seed's tests patch them there)."""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from swap_state.client.torchtitan.version import require_line

require_line("0.2", "swap_state.client.torchtitan.glue (the custom config module's build_optimizers wrapper)")

import torchtitan.components.optimizer as _tt_optimizer  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402

from swap_state.client.optim.kernels import IMPLEMENTATIONS
from swap_state.client.torchtitan import checkpointing
from swap_state.client.torchtitan.settings import (
    SWAP_OPTIMIZER_CLASSES, SwapSettings, build_swap_container, check_choice, embedded_snapshot_dir)

__all__ = [
    "build_optimizers", "current_job_config", "install_build_optimizers_wrapper", "install_job_hooks",
    "original_build_optimizers", "rebind_imported_model_specs"]

_WRAPPED_ORIGINAL_ATTR = "__swap_state_original__"


def build_optimizers(model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: Any,
                     ft_manager: Any = None) -> OptimizersContainer:
    """torchtitan's ``build_optimizers`` plus ``optimizer_config.swap_optimizer`` (Adam or AdamW;
    settings: :class:`SwapSettings`; optimizers-in-backward and TorchFT are not supported)."""
    seed = importlib.import_module("swap_state.client.swap_optimizer")  # the names the seed's tests patch
    if not getattr(optimizer_config, "swap_optimizer", False):
        return seed._original_build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    name = optimizer_config.name
    optimizer_cls = SWAP_OPTIMIZER_CLASSES.get(name)
    if optimizer_cls is None:
        raise NotImplementedError(f"Optimizer {name} not added.")
    if getattr(optimizer_config, "early_step_in_backward", False):
        raise NotImplementedError("swap_optimizer does not support early_step_in_backward")
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise NotImplementedError("swap_optimizer does not support TorchFT")
    optimizer_kwargs = _optimizer_kwargs(optimizer_config)
    settings = SwapSettings.of(optimizer_config)
    # An embedded server keeps the snapshots in <job.dump_folder>/swap-state-snapshots.
    job = getattr(current_job_config.get(), "job", None)
    snapshot_dir = embedded_snapshot_dir(getattr(job, "dump_folder", None))
    return build_swap_container(
        model_parts, optimizer_cls, optimizer_kwargs, settings,
        snapshot_dir=snapshot_dir, local_container_cls=seed.SwapOptimizersContainer,
    )  # fmt: skip


def _optimizer_kwargs(optimizer_config: Any) -> dict[str, Any]:
    """The torch optimizer's keyword arguments from torchtitan's ``[optimizer]`` section."""
    implementation = getattr(optimizer_config, "implementation", "fused")
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    return {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": implementation == "fused",
        "foreach": implementation == "foreach"}


# torchtitan's own function, also when a wrapper was installed before this module was
# (re)imported: a wrapper is never wrapped again.
original_build_optimizers: Callable[..., OptimizersContainer] = getattr(
    _tt_optimizer.build_optimizers, _WRAPPED_ORIGINAL_ATTR, _tt_optimizer.build_optimizers)
setattr(build_optimizers, _WRAPPED_ORIGINAL_ATTR, original_build_optimizers)


def install_build_optimizers_wrapper() -> None:
    """Make torchtitan's ``build_optimizers`` this module's wrapper (idempotent). Call it before
    ``torchtitan.models`` is imported, else :func:`rebind_imported_model_specs`."""
    _tt_optimizer.build_optimizers = build_optimizers


def rebind_imported_model_specs() -> None:
    """Model packages imported before the wrapper captured the unwrapped builder: rebind."""
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.") and getattr(module, "build_optimizers", None) is original_build_optimizers:
            module.build_optimizers = _tt_optimizer.build_optimizers


# -- build_optimizers sees only the [optimizer] section: the rest of the job through idempotent wrappers

#: The JobConfig of the torchtitan ``Trainer`` being built in this context, else None.
current_job_config: contextvars.ContextVar[Any] = contextvars.ContextVar("swap_state_job_config", default=None)


def _wrap_method(cls: type, name: str, hook: Callable[..., Any]) -> None:
    """Replace ``cls.name`` by a method calling ``hook(run, self, ...)``, ``run`` the original (never a wrapper)."""
    current = cls.__dict__.get(name)
    original = getattr(current, _WRAPPED_ORIGINAL_ATTR, current)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(functools.partial(original, self), self, *args, **kwargs)

    setattr(wrapper, _WRAPPED_ORIGINAL_ATTR, original)
    setattr(cls, name, wrapper)


def _trainer_init(run: Callable[..., Any], trainer: Any, job_config: Any, *args: Any, **kwargs: Any) -> None:
    token = current_job_config.set(job_config)
    try:
        run(job_config, *args, **kwargs)
    finally:
        current_job_config.reset(token)


def _checkpoint_manager_init(run: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> None:
    run(*args, **kwargs)
    bound = inspect.signature(run).bind(*args, **kwargs).arguments
    checkpointing.attach(manager, bound.get("checkpoint_config"), bound.get("optimizers"), bound.get("model_parts"))


def install_job_hooks() -> None:
    """Wrap torchtitan's ``CheckpointManager`` and, once ``torchtitan.train`` is imported,
    ``Trainer.__init__`` (it builds the optimizers inside: :data:`current_job_config`)."""
    import torchtitan.components.checkpoint as tt_checkpoint

    hooks = {"__init__": _checkpoint_manager_init, "save": checkpointing.save,
             "_save_last_step": checkpointing.save_last_step, "dcp_load": checkpointing.dcp_load,
             "_should_save": checkpointing.should_save,
             "_purge_stale_checkpoints": checkpointing.purge_stale_checkpoints,
             "_find_load_step": checkpointing.find_load_step, "close": checkpointing.close,
             "__del__": checkpointing.delete}
    for name, hook in hooks.items():
        _wrap_method(tt_checkpoint.CheckpointManager, name, hook)
    trainer = getattr(sys.modules.get("torchtitan.train"), "Trainer", None)
    if isinstance(trainer, type):
        _wrap_method(trainer, "__init__", _trainer_init)

