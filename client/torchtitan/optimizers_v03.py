"""torchtitan 0.3's swap-state optimizer: a ``Configurable`` whose ``Config`` extends
``OptimizersContainer.Config`` with the settings 0.2 names ``optimizer.<name>``.

``Config(...).build(model_parts=...)`` returns the container of ``swap_optimizer_backend``. Adam
and AdamW param groups are swapped (a group's ``decoupled_weight_decay`` decides its update);
groups of other optimizers (``DistMuon``) are left to torchtitan's own (``UnswappedOptimizers``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import (
    get_flat_optim_state_dict, init_optim_state, load_flat_optim_state_dict)

from swap_state.client.optim.container import UnswappedOptimizers
from swap_state.client.remote.config import CheckpointMode
from swap_state.client.torchtitan.settings import (
    SWAP_OPTIMIZER_CLASSES, SwapSettings, build_swap_container, embedded_snapshot_dir)

__all__ = ["BF16_MOMENTS", "SwapStateOptimizersContainer", "build_swap_optimizers"]

logger = logging.getLogger(__name__)

_NOT_TORCH_GROUP_KEYS = ("params", "param_names")
#: torchtitan's implementation with bfloat16 Adam moments of fp32 parameters (fused kernel).
BF16_MOMENTS = "fused_opt_states_bf16"


class SwapStateOptimizersContainer(OptimizersContainer):
    """The Configurable torchtitan 0.3 builds: it returns the configured swap container."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config, SwapSettings):
        """torchtitan's optimizer Config and :class:`SwapSettings`, with 0.3's defaults."""

        swap_optimizer_backend: Literal["local", "remote"] = "remote"
        """'remote': the host's swap-state-server (an embedded one for this trainer when no
        address is given); 'local': pinned memory inside the trainer."""

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
    partitions = {id(model): _Partition.of(config, index, model) for index, model in enumerate(model_parts)}
    unswapped = [optimizer for partition in partitions.values() for optimizer in partition.unswapped]
    if unswapped and settings.swap_state_checkpoint == CheckpointMode.SNAPSHOT:
        others = ", ".join(other for partition in partitions.values() for other in partition.others)
        raise NotImplementedError(
            f"optimizer.swap_state_checkpoint = 'snapshot' keeps the whole state in swap-state's "
            f"snapshots, but param groups {others} are not Adam or AdamW and their state would be "
            "missing there: use swap_state_checkpoint = 'full', or Adam/AdamW for those parameters")
    amsgrad = any(group.get("amsgrad") for partition in partitions.values() for group in partition.swapped)
    snapshot_dir = config.swap_state_snapshot_dir or embedded_snapshot_dir(_trainer_dump_folder(config))
    return build_swap_container(
        model_parts,
        _swap_optimizer_class(config),
        # Every group is complete; amsgrad sizes an embedded server's shared memory.
        {"amsgrad": True} if amsgrad else {},
        settings,
        snapshot_dir=snapshot_dir,
        param_groups=lambda model: partitions[id(model)].swapped,
        moment_dtype=torch.bfloat16 if config.implementation == BF16_MOMENTS else None,
        # 0.3's ModelWrapper checkpoints the module's own state dict (hooks: llama3 splits wqkv).
        model_state_dict=nn.Module.state_dict,
        unswapped=UnswappedOptimizers(unswapped, _flat_state_dict, _load_flat_state_dict) if unswapped else None)


class _Partition:
    """One model part's ``config.param_groups``: the Adam and AdamW groups, completed with their
    optimizer's defaults, and torchtitan's own optimizers for the other groups."""

    def __init__(self, swapped: list[dict[str, Any]], unswapped: list[torch.optim.Optimizer], others: list[str]):
        self.swapped, self.unswapped, self.others = swapped, unswapped, others

    @classmethod
    def of(cls, config: Any, index: int, model: nn.Module) -> _Partition:
        impl_kwargs = OptimizersContainer._build_impl_kwargs(config)
        by_name, patterns = OptimizersContainer._build_param_groups(model, config.param_groups, impl_kwargs)
        swapped: list[dict[str, Any]] = []
        unswapped, others = [], []
        for name, groups in by_name.items():
            factory_kwargs = config.optimizer_factory_kwargs_by_name.get(name, {})
            if name not in SWAP_OPTIMIZER_CLASSES:
                # torchtitan's own optimizer for these groups, built as torchtitan builds it.
                unswapped.append(OptimizersContainer._resolve_optimizer_factory(name)(groups, **factory_kwargs))
                others.extend(f"{name} [{pattern}]" for pattern in patterns[name])
                continue
            for group, pattern in zip(groups, patterns[name], strict=True):
                swapped.append(_complete_group(SWAP_OPTIMIZER_CLASSES[name], group, factory_kwargs))
                logger.info(
                    "swap-state optimizer group %s [%s] (model part %d): %d params, lr=%s, weight_decay=%s",
                    name, pattern, index, len(group["params"]), group.get("lr"), swapped[-1]["weight_decay"],
                )  # fmt: skip
        if others:
            logger.info(
                "swap-state leaves param groups %s (model part %d) to torchtitan's own optimizer: their "
                "state stays in the trainer, checkpointed beside swap-state's", ", ".join(others), index,
            )  # fmt: skip
        if not swapped:
            raise ValueError(f"optimizer.param_groups give model part {index} no Adam or AdamW group: swap-state has "
                             "nothing to keep; train this job without the swap_state override")
        return cls(swapped, unswapped, others)


def _flat_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    init_optim_state(optimizer)  # torchtitan's own order: state materialised first
    return get_flat_optim_state_dict(optimizer)


def _load_flat_state_dict(optimizer: torch.optim.Optimizer, flat: Any) -> None:
    init_optim_state(optimizer)
    load_flat_optim_state_dict(optimizer, flat)


def _complete_group(optimizer_cls: type, group: dict[str, Any], factory_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``group`` with every key torch's ``optimizer_cls`` fills in (from a one-element one)."""
    hyper = {key: value for key, value in group.items() if key not in _NOT_TORCH_GROUP_KEYS}
    template = optimizer_cls([torch.zeros(1)], **{**factory_kwargs, **hyper}).param_groups[0]
    complete = {key: value for key, value in template.items() if key not in _NOT_TORCH_GROUP_KEYS}
    complete["params"] = list(group["params"])
    return complete


def _swap_optimizer_class(config: Any) -> type[torch.optim.Optimizer]:
    """Adam when every swapped group is Adam, else AdamW."""
    names = {group.optimizer_name for group in config.param_groups} & SWAP_OPTIMIZER_CLASSES.keys()
    return torch.optim.Adam if names == {"Adam"} else torch.optim.AdamW


def _trainer_dump_folder(config: Any) -> str | None:
    """The dump folder of the trainer config whose optimizer ``config`` is, else None: torchtitan
    0.3 builds the optimizer from its config alone, so it is a caller's local ``config``."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("config")
        if getattr(candidate, "optimizer", None) is config:
            return getattr(candidate, "dump_folder", None)
        frame = frame.f_back
    return None

