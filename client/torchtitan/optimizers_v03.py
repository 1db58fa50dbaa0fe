"""torchtitan 0.3's swap-state optimizer: a ``Configurable`` whose ``Config`` extends
``OptimizersContainer.Config`` with the settings 0.2 names ``optimizer.<name>``.

``SwapStateOptimizersContainer.Config(...).build(model_parts=...)`` (what torchtitan's trainer
calls) returns the container of ``swap_optimizer_backend``: the in-process
:class:`~swap_state.client.optim.container.SwapOptimizersContainer` (``local``) or
:class:`~swap_state.client.remote.container.RemoteSwapOptimizersContainer` (``remote``: the
host's server, an embedded one without an address). Both are torchtitan
``OptimizersContainer`` subclasses with the flat FQN-keyed state dict torchtitan 0.3 saves, so
checkpoints load with and without swap-state.

Param groups follow torchtitan's ``param_groups`` (first pattern wins, a pattern that matches
nothing is an error), each with its own hyperparameters. Adam and AdamW groups are swapped, in
one torch optimizer per model part (a group's ``decoupled_weight_decay`` is what makes it
AdamW, and the update honours it per group); any other optimizer's groups are refused, naming
them (their state would be missing from swap-state's snapshots).

``implementation = "fused_opt_states_bf16"`` keeps the moments in bfloat16, in the segment, its
snapshots and exports (half the host memory and transfer). On CUDA the update is torch's fused
mixed-precision kernel, as in torchtitan's own optimizer; on the CPU, where torch 2.13 has no such
kernel, swap-state computes the same way in three steps (moments upcast, fp32 fused update,
moments rounded to nearest even): see :func:`swap_state.client.optim.kernels.adam_update`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer

from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.torchtitan.settings import (
    SWAP_OPTIMIZER_CLASSES,
    SwapSettings,
    build_swap_container,
    embedded_snapshot_dir,
)

__all__ = ["SwapStateOptimizersContainer", "build_swap_optimizers", "swap_param_groups"]

logger = logging.getLogger("swap_state.client.torchtitan")

_NOT_TORCH_GROUP_KEYS = ("params", "param_names")
#: torchtitan's implementation with bfloat16 Adam moments of fp32 parameters (fused kernel).
BF16_MOMENTS = "fused_opt_states_bf16"


class SwapStateOptimizersContainer(OptimizersContainer):
    """The Configurable torchtitan 0.3 builds; its ``Config.build`` (and this class, called
    like torchtitan's, ``SwapStateOptimizersContainer(config, model_parts=...)``) returns the
    swap container of the configured backend (:func:`build_swap_optimizers`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        swap_optimizer_times: int = DEFAULT_SWAP_TIMES
        """Number of slices the parameters are split into for the load/update/offload pipeline."""

        swap_optimizer_backend: Literal["local", "remote"] = "remote"
        """'remote': the host's swap-state-server (an embedded one for this trainer when no
        address is given); 'local': pinned memory inside the trainer."""

        swap_state_server: str = ""
        """Server address (unix:///path or tcp://host:port). Empty: $SWAP_STATE_SERVER, else a
        private server started for this trainer (the embedded default)."""

        swap_state_job_id: str = ""
        """Job id shared by all ranks of the run; a restarted trainer with the same job id and
        rank reattaches to its state. Empty: $SWAP_STATE_JOB_ID, else one chosen by rank 0."""

        swap_state_checkpoint: Literal["full", "snapshot"] = "full"
        """'full': state_dict() returns the moments (seed format). 'snapshot': checkpoints are
        whole-state server-side snapshots of model and optimizer; the checkpoint stores two
        small references to one (needs the 'remote' backend; `swap-state export --format
        torchtitan` makes a plain checkpoint of one)."""

        swap_state_server_wait_s: float = 60.0
        """Seconds a save in 'snapshot' mode waits for a swap-state server that is unreachable
        (restarting, being upgraded) before it fails naming the address."""

        swap_state_snapshot_dir: str = ""
        """Where an embedded server keeps the job's snapshots. Empty: the trainer's
        <dump_folder>/swap-state-snapshots, where a rerun of the job finds them."""

        def build(self, **kwargs: Any) -> OptimizersContainer:
            return build_swap_optimizers(self, **kwargs)

    def __new__(cls, config: Config, *, model_parts: list[nn.Module]) -> OptimizersContainer:  # type: ignore[misc]
        return build_swap_optimizers(config, model_parts=model_parts)


def build_swap_optimizers(config: Any, *, model_parts: list[nn.Module]) -> OptimizersContainer:
    """The swap container ``config`` (a ``SwapStateOptimizersContainer.Config``) describes."""
    settings = SwapSettings.of(config)
    optimizer_cls = _swap_optimizer_class(config)
    groups = {id(model): swap_param_groups(config, model) for model in model_parts}
    amsgrad = any(group.get("amsgrad") for model_groups in groups.values() for group in model_groups)
    snapshot_dir = config.swap_state_snapshot_dir or embedded_snapshot_dir(_trainer_dump_folder(config))
    return build_swap_container(
        model_parts,
        optimizer_cls,
        # Every group is complete; amsgrad sizes an embedded server's shared memory.
        {"amsgrad": True} if amsgrad else {},
        settings,
        snapshot_dir=snapshot_dir,
        param_groups=lambda model: groups[id(model)],
        moment_dtype=torch.bfloat16 if config.implementation == BF16_MOMENTS else None,
        # torchtitan 0.3's ModelWrapper checkpoints the module's own state dict (its hooks
        # included: llama3 splits its fused wqkv into wq/wk/wv).
        model_state_dict=nn.Module.state_dict,
    )


def swap_param_groups(config: Any, model: nn.Module) -> list[dict[str, Any]]:
    """The torch param groups of ``model`` under ``config.param_groups``, torchtitan's own
    partition, each completed with its optimizer's defaults (Adam's weight decay is 0,
    AdamW's 0.01), as torchtitan's own optimizers would hold them."""
    impl_kwargs = OptimizersContainer._build_impl_kwargs(config)
    by_name, patterns = OptimizersContainer._build_param_groups(model, config.param_groups, impl_kwargs)
    _refuse_unswapped(by_name, patterns)
    groups = []
    for name, name_groups in by_name.items():
        factory_kwargs = config.optimizer_factory_kwargs_by_name.get(name, {})
        for group, pattern in zip(name_groups, patterns[name], strict=True):
            groups.append(_complete_group(SWAP_OPTIMIZER_CLASSES[name], group, factory_kwargs))
            logger.info(
                "swap-state optimizer group %s [%s]: %d params, lr=%s, weight_decay=%s",
                name, pattern, len(group["params"]), group.get("lr"), groups[-1]["weight_decay"],
            )
    return groups


def _complete_group(optimizer_cls: type, group: dict[str, Any], factory_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``group`` with every key torch's ``optimizer_cls`` would fill in, from a one-element
    optimizer built with the same arguments (so torch's own defaults and checks apply)."""
    hyper = {key: value for key, value in group.items() if key not in _NOT_TORCH_GROUP_KEYS}
    template = optimizer_cls([torch.zeros(1)], **{**factory_kwargs, **hyper}).param_groups[0]
    complete = {key: value for key, value in template.items() if key not in _NOT_TORCH_GROUP_KEYS}
    complete["params"] = list(group["params"])
    return complete


def _refuse_unswapped(by_name: dict[str, list[dict[str, Any]]], patterns: dict[str, list[str]]) -> None:
    unswapped = {name: patterns[name] for name in by_name if name not in SWAP_OPTIMIZER_CLASSES}
    if unswapped:
        listed = "; ".join(f"{name}: {', '.join(map(repr, pats))}" for name, pats in unswapped.items())
        raise NotImplementedError(
            f"swap-state keeps Adam and AdamW state only; optimizer.param_groups has groups of {listed}. "
            "Give those parameters an Adam or AdamW group, or train this job without the "
            "swap_state override"
        )


def _swap_optimizer_class(config: Any) -> type[torch.optim.Optimizer]:
    """Adam when every group is Adam, else AdamW (each group's decoupled_weight_decay decides
    its update; other optimizers' groups are refused by :func:`swap_param_groups`)."""
    names = {group.optimizer_name for group in config.param_groups}
    if not names:
        raise ValueError("optimizer.param_groups is empty: swap-state needs at least one Adam or AdamW group")
    return torch.optim.Adam if names == {"Adam"} else torch.optim.AdamW


def _trainer_dump_folder(config: Any) -> str | None:
    """The dump folder of the trainer config whose optimizer ``config`` is.

    torchtitan 0.3 builds the optimizer from its config alone (``config.optimizer.build(
    model_parts=...)`` in ``Trainer.__init__``); the job's dump folder, where an embedded
    server keeps the job's snapshots so that a rerun finds them, is its caller's. It is read
    from the calling frames: a local ``config`` whose ``optimizer`` is this very object.
    None where there is none (the container was built outside a trainer).
    """
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("config")
        if getattr(candidate, "optimizer", None) is config:
            return getattr(candidate, "dump_folder", None)
        frame = frame.f_back
    return None

