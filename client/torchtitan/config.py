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
from typing import Literal

from swap_state.client.torchtitan.glue import (
    build_remote_container,
    install_build_optimizers_wrapper,
    install_job_hooks,
    rebind_imported_model_specs,
    shared_job_id,
)

__all__ = ["Optimizer", "JobConfig", "build_remote_container", "shared_job_id"]


@dataclass
class Optimizer:
    swap_optimizer: bool = False
    """Keep Adam moments in host memory and stream them to the device during step()."""

    swap_optimizer_times: int = 16
    """Number of slices the parameters are split into for the load/update/offload pipeline."""

    swap_optimizer_backend: Literal["local", "remote"] = "local"
    """'local': pinned memory inside the trainer; 'remote': the host's swap-state-server."""

    swap_state_server: str = ""
    """Server address (unix:///path or tcp://host:port). Empty: $SWAP_STATE_SERVER, else the
    host's server when one answers at the default socket, else a private server started for
    this trainer (the embedded default)."""

    swap_state_job_id: str = ""
    """Job id shared by all ranks of the run; a restarted trainer with the same job id and
    rank reattaches to its state. Empty: $SWAP_STATE_JOB_ID, else one chosen by rank 0."""

    swap_state_checkpoint: Literal["full", "snapshot"] = "full"
    """'full': state_dict() returns the moments (seed format). 'snapshot': checkpoints are
    whole-state server-side snapshots: the model's parameters are copied into the segment
    for each save's step, CheckpointManager.save asks the server for one snapshot of model and
    optimizer and stores two small references to it; a load restores it and puts the
    parameters back (needs swap_optimizer_backend = "remote"; `swap-state export --format
    torchtitan` makes a plain checkpoint of one). Loading follows the checkpoint: a plain
    or 'full' checkpoint loads its tensors in either mode."""


    swap_state_server_wait_s: float = 60.0
    """Seconds a save in 'snapshot' mode waits for a swap-state server that is unreachable
    (restarting after a crash, being upgraded) before it fails naming the address. Training
    steps never wait for the server: they go on while it restarts."""


@dataclass
class JobConfig:
    optimizer: Optimizer = field(default_factory=Optimizer)


install_build_optimizers_wrapper()
rebind_imported_model_specs()
install_job_hooks()
