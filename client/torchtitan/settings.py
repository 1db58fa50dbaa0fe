"""The swap-state settings of a torchtitan job and the container they build, for both lines.

:class:`SwapSettings` declares them once: torchtitan 0.2's ``[optimizer]`` section and 0.3's
optimizer ``Config`` subclass it, and both adapters build with :func:`build_swap_container`, so
a setting means the same on both lines and is checked in one place. No torchtitan import here.
"""

# No "from __future__ import annotations": torchtitan 0.2 merges the [optimizer] dataclass by its
# fields' types, which must be real classes, not strings.
import dataclasses
import enum
import os
import uuid
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.remote.config import CHECKPOINT_MODES, CheckpointMode, RemoteConfig
from swap_state.client.remote.environment import job_id_from_env

__all__ = [
    "BACKENDS", "CHECKPOINT_MODES", "Backend", "SNAPSHOT_SUBDIR", "SWAP_OPTIMIZER_CLASSES", "SwapSettings",
    "build_swap_container", "check_choice", "embedded_snapshot_dir", "shared_job_id", "snapshots_to_keep"]


class Backend(str, enum.Enum):
    """``optimizer.swap_optimizer_backend``: where the moments live (a member equals its string)."""

    LOCAL = "local"
    REMOTE = "remote"


BACKENDS: tuple[str, ...] = tuple(backend.value for backend in Backend)
#: The optimizers whose moments swap-state keeps, by torchtitan's names for them.
SWAP_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
#: Where the embedded server's snapshots go under torchtitan, relative to the dump folder.
SNAPSHOT_SUBDIR = "swap-state-snapshots"


@dataclasses.dataclass(kw_only=True)  # torchtitan 0.3's Configurable takes keyword-only fields
class SwapSettings:
    """The settings both torchtitan lines share (``optimizer.<name>``); 0.3's Config defaults
    ``swap_optimizer_backend`` to 'remote' and adds ``swap_state_snapshot_dir``."""

    swap_optimizer_times: int = DEFAULT_SWAP_TIMES
    """Number of slices the parameters are split into for the load/update/offload pipeline (>= 1)."""

    swap_optimizer_backend: Literal["local", "remote"] = "local"
    """'local': pinned memory inside the trainer; 'remote': the host's swap-state-server."""

    swap_state_server: str = ""
    """Server address (unix:///path or tcp://host:port). Empty: $SWAP_STATE_SERVER, else the host's server when one
    answers at the default socket, else a private server started for this trainer (the embedded default)."""

    swap_state_job_id: str = ""
    """Job id shared by all ranks of the run; a restarted trainer with the same job id and
    rank reattaches to its state. Empty: $SWAP_STATE_JOB_ID, else one chosen by rank 0."""

    swap_state_checkpoint: Literal["full", "snapshot"] = "full"
    """'full': state_dict() returns the moments (seed format). 'snapshot': a checkpoint holds references to a
    whole-state server-side snapshot of model and optimizer (needs swap_optimizer_backend = "remote"; `swap-state
    export` makes a plain one). A load follows the checkpoint: a plain one loads its tensors in either mode."""

    swap_state_server_wait_s: float = RemoteConfig.server_wait_s
    """Seconds a save in 'snapshot' mode (and any snapshot, wait on one or listing) waits for an unreachable swap-state
    server (restarting, being upgraded) before it fails naming the address. Training steps never wait for it."""

    swap_state_replica_interval: int = 0
    """Every this many steps, between torchtitan's checkpoint.interval saves, a checkpoint whose snapshot is
    memory-only: in this host's memory and a peer server's (--replica-peers), never on the disk or store; torchtitan
    writes its small folder as usual. Needs swap_state_checkpoint = 'snapshot' and a server with --replica-peers. A lost
    host costs at most this many steps; 0: none."""

    @classmethod
    def of(cls, config: Any) -> "SwapSettings":
        """The settings of an optimizer config (missing attributes: the defaults), checked."""
        defaults = cls()
        settings = cls(**{f.name: getattr(config, f.name, getattr(defaults, f.name)) for f in dataclasses.fields(cls)})
        settings.check()
        return settings

    def check(self) -> None:
        check_choice("swap_optimizer_backend", self.swap_optimizer_backend, BACKENDS)
        check_choice("swap_state_checkpoint", self.swap_state_checkpoint, CHECKPOINT_MODES)
        times = self.swap_optimizer_times
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"optimizer.swap_optimizer_times must be an integer >= 1, got {times!r}")
        if self.swap_optimizer_backend == Backend.LOCAL and self.swap_state_checkpoint != CheckpointMode.FULL:
            raise ValueError(f"optimizer.swap_state_checkpoint = {self.swap_state_checkpoint!r} needs a swap-state "
                             "server: set optimizer.swap_optimizer_backend = 'remote' (the 'local' backend "
                             "checkpoints 'full')")
        interval = self.swap_state_replica_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"optimizer.swap_state_replica_interval must be an integer >= 0, got {interval!r}")
        if interval and self.swap_state_checkpoint != CheckpointMode.SNAPSHOT:
            raise ValueError("optimizer.swap_state_replica_interval needs optimizer.swap_state_checkpoint = 'snapshot' "
                             "(and swap_optimizer_backend = 'remote'): its checkpoints are memory-only snapshots")


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """ValueError naming ``optimizer.<name>`` and the allowed values unless ``value`` is one."""
    if value not in allowed:
        raise ValueError(f"optimizer.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def snapshots_to_keep(keep_latest_k: int) -> int:
    """The snapshots a job keeps so that every checkpoint torchtitan keeps loads (0: all):
    torchtitan keeps up to ``keep_latest_k + 1`` (its last-step save does not purge)."""
    return 0 if keep_latest_k <= 0 else keep_latest_k + 1


def embedded_snapshot_dir(dump_folder: str | None) -> str | None:
    """``<dump_folder>/swap-state-snapshots`` (absolute); None without a dump folder."""
    return os.path.join(os.path.abspath(os.path.expanduser(dump_folder)), SNAPSHOT_SUBDIR) if dump_folder else None


def shared_job_id(configured: str) -> str:
    """The configured id, else $SWAP_STATE_JOB_ID, else one chosen by rank 0 and broadcast."""
    job_id = configured or job_id_from_env()
    if job_id:
        return job_id
    candidate = [f"job-{uuid.uuid4().hex[:12]}"]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(candidate, src=0)
    return candidate[0]


def build_swap_container(model_parts: list[nn.Module], optimizer_cls: type[torch.optim.Optimizer],
                         optimizer_kwargs: dict[str, Any], settings: SwapSettings, *, snapshot_dir: str | None = None,
                         param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
                         moment_dtype: torch.dtype | None = None,
                         model_state_dict: Callable[[nn.Module], dict[str, Any]] | None = None, unswapped: Any = None,
                         local_container_cls: type | None = None):
    """The container ``settings`` ask for (``local_container_cls``: the seed's tests patch it)."""
    # Only what is set: the seed's tests patch in containers that take none of these.
    given = {"param_groups": param_groups, "moment_dtype": moment_dtype, "unswapped": unswapped}
    extra = {name: value for name, value in given.items() if value is not None}
    if settings.swap_optimizer_backend == Backend.LOCAL:
        from swap_state.client.optim.container import SwapOptimizersContainer

        container_cls = local_container_cls or SwapOptimizersContainer
        return container_cls(model_parts, optimizer_cls, optimizer_kwargs, settings.swap_optimizer_times, **extra)
    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
    from swap_state.client.remote.embedded import EmbeddedServerConfig

    config = RemoteConfig(checkpoint=settings.swap_state_checkpoint,
                          server_wait_s=float(settings.swap_state_server_wait_s),
                          replica_interval=settings.swap_state_replica_interval,
                          embedded=EmbeddedServerConfig(snapshot_dir=snapshot_dir) if snapshot_dir else None,
                          model_state_dict=model_state_dict)
    return RemoteSwapOptimizersContainer(
        model_parts, optimizer_cls, optimizer_kwargs, settings.swap_optimizer_times,
        server=settings.swap_state_server or None, job_id=shared_job_id(settings.swap_state_job_id),
        config=config, **extra,
    )  # fmt: skip
