"""torchtitan 0.3's switch: one override target that turns a run into a swap-state run.

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports swap_state.client.torchtitan_override.swap_state

    # settings, under their 0.2 names, as the target's JSON arguments:
    --override.imports 'swap_state.client.torchtitan_override.swap_state={"swap_state_checkpoint": "snapshot"}'

The target derives both configs swap-state replaces from the ones the run has: the optimizer's
(``OptimizersContainer.Config`` -> :class:`~swap_state.client.torchtitan.optimizers_v03.SwapStateOptimizersContainer`'s
``Config``, keeping the param groups and implementation) and the checkpoint manager's
(``CheckpointManager.Config`` -> :class:`~swap_state.client.torchtitan.checkpoint_v03.SwapStateCheckpointManager`'s).
The settings are ``swap_optimizer_times``, ``swap_optimizer_backend`` (default 'remote'),
``swap_state_server``, ``swap_state_job_id``, ``swap_state_checkpoint``,
``swap_state_server_wait_s`` and ``swap_state_snapshot_dir``; the environment supplies the
server and job id where they are empty (``SWAP_STATE_SERVER``, ``SWAP_STATE_JOB_ID``), as in 0.2.
Other override targets combine with this one in the same flag.

A config registry function of the user's own can build a swap-state config directly
(:func:`with_swap_state`); torchtitan's CLI then also takes the settings as
``--optimizer.<name>``.
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
SETTINGS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(SwapStateOptimizersContainer.Config)
    if f.name not in {g.name for g in dataclasses.fields(OptimizersContainer.Config)}
)
_REPLACED = (OptimizersContainer.Config, BaseCheckpointManager.Config)


class _EitherNode(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _REPLACED)


class SwapStateNodes(Configurable.Config, metaclass=_EitherNode):
    """The target of :func:`swap_state`: the optimizer's and the checkpoint manager's config.

    torchtitan 0.3 activates one override per ``module.function`` and gives each one target
    class; swap-state replaces two nodes of the trainer's config, so this class stands for
    either (``isinstance`` is true for both). Nothing builds it.
    """


@override(
    target=SwapStateNodes,
    description="swap-state: Adam moments on the host's swap-state server (optimizer and checkpoint manager)",
)
def swap_state(config: Any, **settings: Any) -> Any:
    """The swap-state config that replaces ``config`` (the optimizer's or the checkpoint
    manager's); ``settings`` are the target's JSON arguments."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(
            f"--override.imports swap_state.client.torchtitan_override.swap_state: unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(SETTINGS)}"
        )
    if isinstance(config, OptimizersContainer.Config):
        replaced = derive(config, SwapStateOptimizersContainer.Config, **settings)
        SwapSettings.of(replaced)  # a bad value fails now, naming the setting
        return replaced
    if type(config) not in (CheckpointManager.Config, SwapStateCheckpointManager.Config):
        raise NotImplementedError(
            f"swap-state extends torchtitan's CheckpointManager; this run's checkpoint config is "
            f"{type(config).__qualname__}"
        )
    return derive(config, SwapStateCheckpointManager.Config)


def with_swap_state(trainer_config: Any, **settings: Any) -> Any:
    """``trainer_config`` (a ``Trainer.Config``, changed in place and returned) as a swap-state
    run: for a config registry function of the user's own, e.g.
    ``return with_swap_state(llama3_debugmodel(), swap_state_checkpoint="snapshot")``."""
    trainer_config.optimizer = swap_state(trainer_config.optimizer, **settings)
    trainer_config.checkpoint = swap_state(trainer_config.checkpoint)
    return trainer_config
