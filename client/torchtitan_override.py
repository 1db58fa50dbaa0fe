"""torchtitan 0.3's switch: one override target that turns a run into a swap-state run.

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports swap_state.client.torchtitan_override.swap_state

    # settings, under their 0.2 names, as the target's JSON arguments:
    --override.imports 'swap_state.client.torchtitan_override.swap_state={"swap_state_checkpoint": "snapshot"}'

The target derives the optimizer's and the checkpoint manager's configs from the run's; a
config registry function of the user's own can call :func:`with_swap_state` instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swap_state.client.torchtitan.version import require_line

require_line("0.3", "swap_state.client.torchtitan_override")

from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.config import Configurable, derive, override  # noqa: E402

from swap_state.client.torchtitan.checkpoint_v03 import SwapStateCheckpointManager  # noqa: E402
from swap_state.client.torchtitan.optimizers_v03 import SwapStateOptimizersContainer  # noqa: E402
from swap_state.client.torchtitan.settings import SwapSettings  # noqa: E402

__all__ = ["SETTINGS", "SwapStateNodes", "swap_state", "with_swap_state"]

#: The settings the target takes (the fields swap-state adds to the optimizer's Config).
SETTINGS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SwapStateOptimizersContainer.Config)
                                  if f.name not in {g.name for g in dataclasses.fields(OptimizersContainer.Config)})
_REPLACED = (OptimizersContainer.Config, BaseCheckpointManager.Config)


class _EitherNode(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _REPLACED)


class SwapStateNodes(Configurable.Config, metaclass=_EitherNode):
    """The target of :func:`swap_state`: torchtitan 0.3 gives an override one target class, and
    swap-state replaces two config nodes, so this stands for either. Nothing builds it."""


@override(
    target=SwapStateNodes,
    description="swap-state: Adam moments on the host's swap-state server (optimizer and checkpoint manager)")
def swap_state(config: Any, **settings: Any) -> Any:
    """The swap-state config that replaces ``config`` (the optimizer's or the checkpoint
    manager's); ``settings`` are the target's JSON arguments."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"--override.imports swap_state.client.torchtitan_override.swap_state: unknown setting(s) "
                         f"{', '.join(unknown)}; the settings are {', '.join(SETTINGS)}")
    if isinstance(config, OptimizersContainer.Config):
        replaced = derive(config, SwapStateOptimizersContainer.Config, **settings)
        SwapSettings.of(replaced)  # a bad value fails now, naming the setting
        return replaced
    if type(config) not in (CheckpointManager.Config, SwapStateCheckpointManager.Config):
        raise NotImplementedError(f"swap-state extends torchtitan's CheckpointManager; this run's checkpoint "
                                  f"config is {type(config).__qualname__}")
    return derive(config, SwapStateCheckpointManager.Config)


def with_swap_state(trainer_config: Any, **settings: Any) -> Any:
    """``trainer_config`` (a ``Trainer.Config``, changed in place and returned) as a swap-state
    run: for a config registry function of the user's own, e.g.
    ``return with_swap_state(llama3_debugmodel(), swap_state_checkpoint="snapshot")``."""
    trainer_config.optimizer = swap_state(trainer_config.optimizer, **settings)
    trainer_config.checkpoint = swap_state(trainer_config.checkpoint)
    return trainer_config
