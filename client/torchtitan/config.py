"""torchtitan 0.2.x custom config module (``--job.custom_config_module=swap_state.client.torchtitan_config`` and
``swap_optimizer = true`` under ``[optimizer]``); importing it installs the ``build_optimizers`` wrapper and the job
hooks (docs/torchtitan.md)."""

# No "from __future__ import annotations": torchtitan merges these dataclasses by field type.
from dataclasses import dataclass, field

from swap_state.client.torchtitan.glue import (
    install_build_optimizers_wrapper, install_job_hooks, rebind_imported_model_specs)
from swap_state.client.torchtitan.settings import SwapSettings, shared_job_id

__all__ = ["Optimizer", "JobConfig", "shared_job_id"]


@dataclass
class Optimizer(SwapSettings):
    """The ``[optimizer]`` switches: :class:`SwapSettings` and ``swap_optimizer``, 0.2's switch."""

    swap_optimizer: bool = False
    """Keep Adam moments in host memory and stream them to the device during step()."""


@dataclass
class JobConfig:
    optimizer: Optimizer = field(default_factory=Optimizer)


install_build_optimizers_wrapper()
rebind_imported_model_specs()
install_job_hooks()
