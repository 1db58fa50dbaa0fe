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

Importing this module installs the ``build_optimizers`` wrapper
(:mod:`swap_state.client.torchtitan.glue`) and rebinds model packages imported before it, so
torchtitan's trainer builds the swap container when ``swap_optimizer`` is true and torch's
own optimizers otherwise. It also wraps ``Trainer.__init__`` (the job config is current while
it builds the optimizers) and ``CheckpointManager.__init__`` / ``dcp_load``, so that:

- the embedded server (no ``swap_state_server``, no ``$SWAP_STATE_SERVER``, no server at the
  default socket) keeps its
  snapshots in ``<job.dump_folder>/swap-state-snapshots`` (``rank-<r>`` below it with several
  ranks), where a rerun of the job finds them;
- snapshot retention follows ``checkpoint.keep_latest_k`` (0: keep all), so every checkpoint
  torchtitan keeps can be loaded: the server keeps ``keep_latest_k + 1`` (torchtitan's
  last-step save does not purge) or its own --keep-latest, whichever is more;
- ``CheckpointManager.close`` (at the trainer's end) waits until the snapshot the last
  checkpoint refers to is durable;
- the load template matches the checkpoint: a plain torch AdamW checkpoint resumes under
  swap-state ('full' or 'snapshot'), a 'full' one under torch's AdamW, and a 'snapshot' one
  loaded with ``swap_optimizer = false`` fails naming ``swap-state export``.

Bad values (``swap_optimizer_backend``, ``swap_state_checkpoint``, ``implementation``,
``swap_optimizer_times`` < 1) raise ValueError naming the field and the allowed values.
"""

# No "from __future__ import annotations": torchtitan merges these dataclasses by their
# field types, which must be real classes, not strings.
from dataclasses import dataclass, field

from swap_state.client.torchtitan.glue import (
    build_remote_container,
    install_build_optimizers_wrapper,
    install_job_hooks,
    rebind_imported_model_specs,
    shared_job_id,
)
from swap_state.client.torchtitan.settings import SwapSettings

__all__ = ["Optimizer", "JobConfig", "build_remote_container", "shared_job_id"]


@dataclass
class Optimizer(SwapSettings):
    """The ``[optimizer]`` switches: :class:`SwapSettings` (declared there, once for both
    torchtitan lines) and ``swap_optimizer``, 0.2's switch."""

    swap_optimizer: bool = False
    """Keep Adam moments in host memory and stream them to the device during step()."""


@dataclass
class JobConfig:
    optimizer: Optimizer = field(default_factory=Optimizer)


install_build_optimizers_wrapper()
rebind_imported_model_specs()
install_job_hooks()
