"""torchtitan 0.2.x custom config module: the ``[optimizer]`` switches of swap-state.

Use it with ``--job.custom_config_module=swap_state.client.torchtitan_config`` (or
``custom_config_module`` under ``[job]`` in the TOML)::

    [optimizer]
    name = "AdamW"
    swap_optimizer = true
    swap_optimizer_times = 16
    swap_optimizer_backend = "remote"          # "local": in-process pinned host cache
    swap_state_server = "unix:///run/swap-state/swap-state.sock"   # "" -> $SWAP_STATE_SERVER
    swap_state_job_id = "llama3-8b-run1"       # "" -> $SWAP_STATE_JOB_ID, else a uuid from rank 0
    swap_state_checkpoint = "snapshot"         # whole-state snapshots; "full": the seed's state dict
    swap_state_server_wait_s = 60.0            # a save waits this long for a restarting server

Importing this module installs the ``build_optimizers`` wrapper and the job hooks
(:mod:`swap_state.client.torchtitan.glue`; what they do: docs/torchtitan.md). Bad values raise
ValueError naming the field and the allowed values.
"""

# No "from __future__ import annotations": torchtitan merges these dataclasses by field type.
from dataclasses import dataclass, field

from swap_state.client.torchtitan.glue import (
    build_remote_container, install_build_optimizers_wrapper, install_job_hooks,
    rebind_imported_model_specs, shared_job_id,
)
from swap_state.client.torchtitan.settings import SwapSettings

__all__ = ["Optimizer", "JobConfig", "build_remote_container", "shared_job_id"]


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
