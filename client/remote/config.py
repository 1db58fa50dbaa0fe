"""Settings of a remote container, resolved in order: constructor argument, :class:`RemoteConfig`,
environment (torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, ``SWAP_STATE_*``), default.
Without an address: the host's server at the default socket, else a private embedded one.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import logging
import os
import stat
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from swap_state.client.optim.dtensor_utils import unwrap_dtensor
from swap_state.client.remote.model_area import model_state_bytes
from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig, default_snapshot_dir
from swap_state.client.errors import ServerUnavailableError
from swap_state.client.remote.environment import (
    ENV_JOB_ID, ENV_SERVER, ENV_TOKEN_FILE, job_id_from_env, server_from_env)
from swap_state.client.remote.rpc import ClientConfig, RemoteSession, SwapStateClient
from swap_state.common.addresses import default_socket_path

__all__ = [
    "CheckpointMode", "ENV_JOB_ID", "ENV_SERVER", "ENV_TOKEN_FILE", "RemoteConfig", "connect",
    "embedded_config_for", "embedded_world_size_hint", "host_server", "resolve_config", "snapshots_model"]

HOST_SERVER_PROBE_S = 2.0  # how long the trainer asks the default socket whether a server answers

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RemoteConfig(ClientConfig):
    """A remote container's settings: how to reach the server (:class:`ClientConfig`), then the job's."""

    job_id: str | None = None
    """Shared by all ranks of a run; None: $SWAP_STATE_JOB_ID, else a fresh id (no reattach)."""
    rank: int | None = None
    """None: torch.distributed's rank when initialised, else $RANK, else 0."""
    world_size: int | None = None
    """None: torch.distributed's world size when initialised, else $WORLD_SIZE, else 1."""
    local_world_size: int | None = None
    """Ranks attached to this rank's server; None: $LOCAL_WORLD_SIZE, else world_size (embedded: 1)."""
    backpressure_timeout_s: float = 300.0
    """Longest wait for a copy-before-write slot, or for a snapshot still persisting."""
    embedded: EmbeddedServerConfig | None = None
    """Settings of the embedded server; None: sized from the model."""
    checkpoint: str = "full"
    """'full': state_dict() holds the moments; 'snapshot': a reference to a server-side snapshot."""
    snapshot_model: bool | None = None
    """Whole-state snapshots: the segment also holds the model's tensors; None: on in 'snapshot' mode."""
    model_state_dict: Callable[[nn.Module], dict[str, Any]] | None = None
    """How the model's checkpoint form is read; None: torch's ``get_model_state_dict``."""
    snapshot_replace_existing: bool = False
    """A snapshot of a step with a durable one from an earlier attempt replaces it (else refused)."""
    snapshot_keep_latest: int | None = None
    """This job's snapshots the server must keep (0: all); None: the server's --keep-latest alone."""
    replica_interval: int = 0
    """Every this many steps a memory-only snapshot (in the host's memory and a peer server's,
    ``--replica-peers``; never on disk), taken as the next step begins, unless that step was
    snapshotted already (a checkpoint); 0: none. A lost host then costs at most this many steps;
    ``swap-state plan`` gives the shortest interval the link and the step time allow."""


class CheckpointMode(str, enum.Enum):
    """``RemoteConfig.checkpoint``: what ``state_dict()`` returns (a member equals its string)."""

    FULL = "full"
    """The seed's flat dict with the moments."""
    SNAPSHOT = "snapshot"
    """A reference to a server-side snapshot, plus param groups and steps."""


CHECKPOINT_MODES: tuple[str, ...] = tuple(mode.value for mode in CheckpointMode)


def snapshots_model(config: RemoteConfig) -> bool:
    """Whether the segment holds the model too (``RemoteConfig.snapshot_model``)."""
    return config.checkpoint == CheckpointMode.SNAPSHOT if config.snapshot_model is None else bool(config.snapshot_model)


def snapshot_retention(config: RemoteConfig) -> dict[str, Any]:
    """The ``keep_latest``/``keep_all``/``replace_existing`` a job's Snapshot calls carry."""
    retention: dict[str, Any] = {"replace_existing": True} if config.snapshot_replace_existing else {}
    keep = config.snapshot_keep_latest
    if keep is not None:
        retention.update({"keep_all": True} if keep == 0 else {"keep_latest": int(keep)})
    return retention


def follow_checkpoint_retention(config: RemoteConfig, keep_latest_k: int) -> None:
    """Keep the snapshots a job's checkpoints refer to: ``keep_latest_k`` (0: all) becomes
    ``snapshot_keep_latest`` unless set; a step trained again replaces its snapshot."""
    config.snapshot_replace_existing = True
    if config.snapshot_keep_latest is not None:
        return
    keep = int(keep_latest_k)
    if keep < 0:
        raise ValueError(f"checkpoint.keep_latest_k must be >= 0, got {keep_latest_k!r}")
    config.snapshot_keep_latest = keep
    log.info("snapshots of job %s follow the checkpoint retention: %s",
             config.job_id, "keep all" if keep == 0 else f"keep the latest {keep}")


def resolve_config(config: RemoteConfig | None, server: str | None, job_id: str | None) -> RemoteConfig:
    """A validated copy of ``config`` with the address and job id from arguments or environment."""
    config = dataclasses.replace(config or RemoteConfig())
    if config.checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"RemoteConfig.checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, "
                         f"got {config.checkpoint!r}")
    keep = config.snapshot_keep_latest
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        raise ValueError(f"RemoteConfig.snapshot_keep_latest must be None or an integer >= 0 (0: keep all), "
                         f"got {keep!r}")
    config.server = server or config.server or server_from_env()
    config.job_id = job_id or config.job_id or job_id_from_env()
    return config


def connect(config: RemoteConfig, model_parts: Sequence[nn.Module], optimizer_kwargs: dict[str, Any]
            ) -> tuple[SwapStateClient, RemoteSession, EmbeddedServer | None]:
    """Fill in ``config.server`` (the host's, else an embedded one) and ``job_id``, then attach;
    the caller owns (and closes) what it returns."""
    embedded = None
    if config.rank is not None and config.world_size is not None:
        rank, world_size = config.rank, config.world_size
    elif dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if config.server is None:
        config.server = host_server()
    if config.server is None:
        if world_size > 1 and rank == 0:  # every rank starts its own; rank 0 says so
            log.warning("no swap-state-server for this job: none is configured (RemoteConfig.server, $%s; "
                        "torchtitan: optimizer.swap_state_server) and none answers at %s, so each of its %d ranks "
                        "starts a private server: no shared memory budget per host, no --snapshot-store. Start one "
                        "per host (swap-state-server --shm-size SIZE) or set $%s", ENV_SERVER, default_socket_path(),
                        world_size, ENV_SERVER)
        embedded = EmbeddedServer(embedded_config_for(config, model_parts, optimizer_kwargs, rank, world_size))
        embedded.start()
        config.server = embedded.address
    if config.job_id is None:
        config.job_id = f"job-{uuid.uuid4().hex[:12]}"
    local_world_size = _resolve_local_world_size(config, world_size, embedded is not None)
    client = SwapStateClient(config)
    try:
        session = client.attach(config.job_id, rank, world_size, local_world_size)
    except BaseException:
        client.close()
        if embedded is not None:
            embedded.stop()
        raise
    return client, session, embedded


def host_server() -> str | None:
    """The default socket's address when a server (of this user or root) answers there, else None."""
    path = default_socket_path()
    try:
        info = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid not in (os.getuid(), 0):
        return None
    address = f"unix://{path}"
    client = SwapStateClient(ClientConfig(address, connect_timeout_s=HOST_SERVER_PROBE_S))
    try:
        client.wait_ready(HOST_SERVER_PROBE_S)
    except ServerUnavailableError:
        return None
    finally:
        client.close()
    log.info("using the host's swap-state-server at %s (its default socket)", address)
    return address


def embedded_config_for(config: RemoteConfig, model_parts: Sequence[nn.Module],
                        optimizer_kwargs: dict[str, Any], rank: int, world_size: int) -> EmbeddedServerConfig:
    """``config.embedded`` sized from the model when it names no size; with several ranks, a
    snapshot directory of this rank's own (``<dir>/rank-<rank>``: two servers never share one)."""
    embedded = config.embedded or EmbeddedServerConfig()
    if embedded.shm_size_bytes is None:
        keys = 3 if optimizer_kwargs.get("amsgrad") else 2  # the moments, a page of slack per tensor
        local = (unwrap_dtensor(p) for m in model_parts for p in m.parameters())
        state = sum(keys * t.numel() * t.element_size() + 4096 for t in local)
        cow = embedded.setting("cow_budget")
        if snapshots_model(config):
            # Pause-free whole-state snapshots need copy slots for the whole state.
            state += model_state_bytes(model_parts, config.model_state_dict)
            if cow is None:
                chunk = embedded.setting("chunk_bytes")
                cow = -(-state // chunk) * chunk
        size = max(64 << 20, int(state * 1.5) + (32 << 20)) + (cow or 0)
        server = embedded.server if cow is None else {**embedded.server, "cow_budget": cow}
        embedded = dataclasses.replace(embedded, shm_size_bytes=size, server=server)
    if world_size > 1:
        root = embedded.snapshot_dir or default_snapshot_dir()
        embedded = dataclasses.replace(embedded, snapshot_dir=os.path.join(root, f"rank-{rank:05d}"))
    return embedded


def embedded_world_size_hint(snapshot_dir: str, job_id: str, world_size: int) -> str:
    """What to do when the embedded servers of a run of another size took ``job_id``'s snapshots."""
    root = os.path.dirname(snapshot_dir) if world_size > 1 else snapshot_dir
    ranks = sorted(glob.glob(os.path.join(glob.escape(root), "rank-*", job_id)))
    if ranks and world_size == 1:
        taken = f"{len(ranks)} ranks' embedded servers, in {root}/rank-*"
    elif world_size > 1 and os.path.isdir(os.path.join(root, job_id)):
        taken = f"a one-rank run's embedded server, in {root}"
    else:
        return ""
    return (f"; this job's snapshots there were taken by {taken}: an embedded server restores the "
            f"files of its own rank in a run of the same size only. To resume at another world size, "
            "run one swap-state-server per host with a shared --snapshot-store, or write the "
            f"checkpoint as a plain one (swap-state export CHECKPOINT OUT --format torchtitan "
            f"--snapshot-dir {root}) and load that")


def _resolve_local_world_size(config: RemoteConfig, world_size: int, embedded: bool) -> int:
    if config.local_world_size is not None:
        return config.local_world_size
    if embedded:
        return 1
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if not env:
        return world_size
    try:
        local = int(env)
    except ValueError:
        raise ValueError(f"$LOCAL_WORLD_SIZE {env!r} is not an integer") from None
    if not 1 <= local <= world_size:
        raise ValueError(f"$LOCAL_WORLD_SIZE {local} is not in [1, world_size {world_size}]: set "
                         "RemoteConfig.local_world_size to the number of ranks attached to this server")
    return local
