"""``RemoteSwapOptimizersContainer``: the swap optimizer with its host cache in the host's
swap-state-server.

Same behaviour and checkpoint contract as :class:`SwapOptimizersContainer` (the seed's flat
state dict, tied-parameter aliases, DTensor layout, rollback on a failed load); the host cache
is a set of views on the session's shared-memory segment instead of process-local memory.

Call order::

    c = RemoteSwapOptimizersContainer(model_parts, torch.optim.AdamW, kwargs, 8,
                                      server="unix:///run/swap-state/swap-state.sock",
                                      job_id="run1")
        # attach -> allocate -> map -> register for DMA (once) -> views become the cache
        # (a reattach within the server's --grace finds the moments of c.resumed_step)
    for step in ...:
        loss.backward(); c.step(); c.zero_grad()    # exactly one CommitStep RPC per step
        if step % 100 == 0:
            c.snapshot()                             # one RPC; returns when consistent
    c.close()                                        # detach (also at interpreter exit)
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.client.errors import NotFoundError, SnapshotBusyError
from swap_state.client.rpc import ClientConfig, RemoteSession, SwapStateClient, SwapStateError
from swap_state.client.shm import SegmentMapping, dtype_name
from swap_state.client.snapshot_guard import SnapshotGuard
from swap_state.client.swap_optimizer import (
    DEFAULT_SWAP_TIMES,
    STEP_KEY,
    DTensor,
    HostCacheEntry,
    SwapOptimizersContainer,
)
from swap_state.common.segment import Word

__all__ = ["RemoteConfig", "RemoteSwapOptimizersContainer", "SnapshotHandle"]

log = logging.getLogger(__name__)

PARAM_STEPS = "swap_state.param_steps"
GROUP_STEPS = "swap_state.group_steps"
#: Keys of a snapshot-mode state dict (beside the seed's ``param_groups.*`` / ``state.*.step``).
SNAPSHOT_REF_KEY = "swap_state.snapshot_id"
SNAPSHOT_JOB_KEY = "swap_state.job_id"


@dataclasses.dataclass
class RemoteConfig:
    server: str | None = None
    """Server address; None: $SWAP_STATE_SERVER, else the embedded default (a private server)."""
    job_id: str | None = None
    """Shared by all ranks of a run; None: $SWAP_STATE_JOB_ID, else a fresh id (no reattach)."""
    rank: int | None = None
    """None: torch.distributed's rank when initialised, else $RANK, else 0."""
    world_size: int | None = None
    """None: torch.distributed's world size when initialised, else $WORLD_SIZE, else 1."""
    local_world_size: int | None = None
    """Ranks of the job that attach to the same server as this one (one server per host), in
    1..world_size; a snapshot on that server is durable once they all have persisted it.
    None: $LOCAL_WORLD_SIZE (torchrun sets it) when set, else world_size (all on one host);
    with the embedded server (private to this process) always 1."""
    token: str | None = None
    """None: the contents of $SWAP_STATE_TOKEN_FILE when set."""
    rpc_timeout_s: float = 10.0
    """Deadline of every control RPC."""
    connect_timeout_s: float = 10.0
    """How long attach waits for an unreachable server before failing."""
    backpressure_timeout_s: float = 300.0
    """Longest wait for a free copy-before-write slot during a snapshot, and for a snapshot
    still persisting (before a new snapshot, a restore, or loading a reference to it)."""
    embedded: EmbeddedServerConfig | None = None
    """Settings of the embedded server; None: sized from the model."""
    checkpoint: str = "full"
    """'full': state_dict() holds the moments (the seed's format). 'snapshot': state_dict()
    takes a server-side snapshot and holds only a reference, param groups and step counts;
    load_state_dict() of such a dict restores the snapshot on the server."""


@dataclasses.dataclass
class SnapshotHandle:
    """A snapshot in progress; ``wait_durable()`` blocks until it is on disk."""

    snapshot_id: str
    step: int
    rank: int
    client: SwapStateClient

    def status(self, wait_s: float = 0.0):
        return self.client.snapshot_status(self.snapshot_id, self.rank, wait_s)

    def wait_durable(self, timeout_s: float = 600.0):
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            reply = self.status(wait_s=max(0.0, min(remaining, 5.0)))
            if reply.state == "durable":
                return reply
            if reply.state == "failed":
                raise SwapStateError(f"snapshot {self.snapshot_id} failed: {reply.error}")
            if remaining <= 0:
                raise TimeoutError(
                    f"snapshot {self.snapshot_id} not durable after {timeout_s}s "
                    f"({reply.bytes_persisted}/{reply.bytes_total} bytes)"
                )


def _resolve_rank_world(config: RemoteConfig) -> tuple[int, int]:
    if config.rank is not None and config.world_size is not None:
        return config.rank, config.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _resolve_local_world_size(config: RemoteConfig, world_size: int, embedded: bool) -> int:
    """RemoteConfig.local_world_size, else $LOCAL_WORLD_SIZE, else world_size (1 for the
    embedded server: it serves this process only)."""
    if config.local_world_size is not None:
        return config.local_world_size
    if embedded:
        return 1
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env:
        try:
            local = int(env)
        except ValueError:
            raise ValueError(f"$LOCAL_WORLD_SIZE {env!r} is not an integer") from None
        if not 1 <= local <= world_size:
            raise ValueError(
                f"$LOCAL_WORLD_SIZE {local} is not in [1, world_size {world_size}]: set "
                "RemoteConfig.local_world_size to the number of ranks attached to this server"
            )
        return local
    return world_size


def _read_token(config: RemoteConfig) -> str | None:
    if config.token is not None:
        return config.token
    path = os.environ.get("SWAP_STATE_TOKEN_FILE")
    if not path:
        return None
    with open(path) as f:
        return f.read().strip()


def _state_bytes(model_parts: Sequence[nn.Module], kwargs: dict[str, Any]) -> int:
    keys = 3 if kwargs.get("amsgrad") else 2
    local = (p.to_local() if isinstance(p, DTensor) else p for m in model_parts for p in m.parameters())
    return sum(keys * t.numel() * t.element_size() + 4096 for t in local)


class RemoteSwapOptimizersContainer(SwapOptimizersContainer):
    """Swap optimizer whose host cache lives in swap-state-server's shared memory."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: dict[str, Any],
        swap_optimizer_times: int = DEFAULT_SWAP_TIMES,
        *,
        server: str | None = None,
        job_id: str | None = None,
        config: RemoteConfig | None = None,
        **container_kwargs: Any,
    ) -> None:
        config = dataclasses.replace(config or RemoteConfig())
        config.server = server or config.server or os.environ.get("SWAP_STATE_SERVER") or None
        config.job_id = job_id or config.job_id or os.environ.get("SWAP_STATE_JOB_ID") or None
        self.remote_config = config
        self._embedded: EmbeddedServer | None = None
        self._mapping: SegmentMapping | None = None
        self._guard: SnapshotGuard | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._closed = False
        self.session = self._connect(model_parts, optimizer_kwargs)
        self.resumed_step: int | None = None
        try:
            super().__init__(model_parts, optimizer_cls, optimizer_kwargs, swap_optimizer_times, **container_kwargs)
            self._resume_group_steps()
        except BaseException:
            self.close()
            raise
        # close() at exit without keeping the container alive
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- connection ------------------------------------------------------------------------
    def _connect(self, model_parts: Sequence[nn.Module], kwargs: dict[str, Any]) -> RemoteSession:
        config = self.remote_config
        if config.server is None:
            embedded_config = config.embedded or EmbeddedServerConfig(
                shm_size_bytes=max(64 << 20, int(_state_bytes(model_parts, kwargs) * 1.5) + (32 << 20))
            )
            self._embedded = EmbeddedServer(embedded_config).start()
            config.server = self._embedded.address
        if config.job_id is None:
            config.job_id = f"job-{uuid.uuid4().hex[:12]}"
        rank, world_size = _resolve_rank_world(config)
        local_world_size = _resolve_local_world_size(config, world_size, self._embedded is not None)
        self.client = SwapStateClient(
            ClientConfig(
                config.server,
                token=_read_token(config),
                timeout_s=config.rpc_timeout_s,
                connect_timeout_s=config.connect_timeout_s,
            )
        )
        try:
            return self.client.attach(config.job_id, rank, world_size, local_world_size)
        except BaseException:
            self.client.close()
            if self._embedded is not None:
                self._embedded.stop()
            raise

    # -- hooks -------------------------------------------------------------------------------
    def _allocate_host_cache(self, entries: Sequence[HostCacheEntry]) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """One Allocate RPC for every moment, the per-param steps and the group steps."""
        if self._mapping is not None:
            raise NotImplementedError(
                "RemoteSwapOptimizersContainer allocates its segment once: every parameter "
                "and param group must exist when the container is built"
            )
        n_groups = sum(len(o.param_groups) for o in self.optimizers)
        specs: list[tuple[str, str, list[int]]] = [
            (PARAM_STEPS, "float32", [len(entries)]),
            (GROUP_STEPS, "float32", [n_groups]),
        ]
        for entry in entries:
            specs.extend(
                (f"state.{entry.fqn}.{key}", dtype_name(entry.dtype), list(entry.shape)) for key in entry.keys
            )
        reply = self.session.allocate(specs)
        self._mapping = SegmentMapping.open(reply.segment)
        self._mapping.register_for_dma(self._backend)
        self._views = self._mapping.tensor_views()
        self._check_resumable(reply.reused)
        self._guard = SnapshotGuard(self._mapping, self.remote_config.backpressure_timeout_s)
        self._tensor_names: dict[torch.Tensor, list[str]] = {}
        cache: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        param_steps = self._views[PARAM_STEPS]
        for index, entry in enumerate(entries):
            names = [f"state.{entry.fqn}.{key}" for key in entry.keys]
            cache[entry.param] = {key: self._views[n] for key, n in zip(entry.keys, names)}
            cache[entry.param][STEP_KEY] = param_steps[index]
            self._tensor_names[entry.param] = names
        self._entries = list(entries)
        return cache

    def _check_resumable(self, reused: bool) -> None:
        header = self._mapping.header
        self._torn_step: int | None = None
        if reused and header[Word.WRITING_STEP] != 0:
            # The previous trainer died mid-step: some moments are of step S, some of S-1.
            self._torn_step = header[Word.WRITING_STEP] - 1
            log.warning("%s", self._torn_message())
        elif reused:
            self._resume_kept_step()
        header[Word.TRAINER_GENERATION] = self.session.generation

    def _resume_kept_step(self) -> None:
        """The step the kept segment holds is the one its group steps say (written with the
        moments, before the commit). A trainer killed between its last write and its
        CommitStep leaves one step more than the server recorded: complete, so it is
        committed now rather than mistaken for the step before."""
        held = int(max(self._views[GROUP_STEPS].tolist(), default=0))
        committed = self.session.last_committed_step
        if held == 0 and committed is None:
            return  # nothing was ever written
        if held != committed:
            log.warning(
                "the previous trainer wrote step %d completely but the server recorded step %d "
                "(killed before its commit): resuming at step %d", held, committed, held,
            )  # fmt: skip
            self.session.commit(held)
        self.resumed_step = held
        log.info("reattached to swap-state at step %d", held)

    def _torn_message(self) -> str:
        return (
            f"the kept optimizer state of {self.remote_config.job_id}/rank {self.session.rank} "
            f"is torn: the previous trainer died while writing step {self._torn_step}. "
            "Restore a snapshot (container.restore('latest')) or load a full checkpoint "
            "before stepping, or use a new job id"
        )

    def _resume_group_steps(self) -> None:
        """After a reattach, the group steps come back from the segment like the moments."""
        if self.resumed_step is None:
            return
        group_steps = self._views[GROUP_STEPS]
        for index, group in enumerate(g for o in self.optimizers for g in o.param_groups):
            group[STEP_KEY] = group_steps[index].clone()

    def _before_host_write(self, params: Sequence[torch.Tensor]) -> None:
        if self._torn_step is not None:
            raise SwapStateError(self._torn_message())
        # The step tensors change with every slice, so they are guarded every time.
        names = [PARAM_STEPS, GROUP_STEPS]
        names += [n for p in params for n in self._tensor_names.get(p, ())]
        self._guard.before_write(self._current_step(), names)

    def _current_step(self) -> int:
        steps = [g[STEP_KEY] for o in self.optimizers for g in o.param_groups if STEP_KEY in g]
        return int(max((float(s) for s in steps), default=0))

    def _publish_step(self) -> int:
        """Group steps into the segment, clear the writing mark, commit: in that order."""
        step = self._current_step()
        group_steps = self._views[GROUP_STEPS]
        for index, group in enumerate(g for o in self.optimizers for g in o.param_groups):
            group_steps[index] = float(group.get(STEP_KEY, 0))
        self._guard.end_write()
        self.session.commit(step)
        return step

    def _after_step(self) -> None:
        self._publish_step()

    def _after_load_state_dict(self) -> None:
        self._guard.before_write(self._current_step(), [GROUP_STEPS])
        self._publish_step()

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_metadata(self) -> str:
        """What the server cannot know: fqns, keys, DTensor layout, param groups, steps."""
        tensors: dict[str, dict[str, Any]] = {}
        steps: dict[str, float] = {}
        param_groups: dict[str, dict[str, Any]] = {}
        flat_groups = self.state_dict_param_groups()
        for entry in self._entries:
            layout = _dtensor_layout(entry.param)
            for key, name in zip(entry.keys, self._tensor_names[entry.param]):
                tensors[name] = {"fqn": entry.fqn, "key": key, **layout}
            steps[entry.fqn] = float(self.param_to_cpu_states_map[entry.param][STEP_KEY])
            param_groups[entry.fqn] = flat_groups[entry.fqn]
        return json.dumps({"tensors": tensors, "steps": steps, "param_groups": param_groups})

    def state_dict_param_groups(self) -> dict[str, dict[str, Any]]:
        """Per canonical fqn, the JSON form of its param group's hyperparameters."""
        out: dict[str, dict[str, Any]] = {}
        for entry in self._entries:
            group = self.optimizers[entry.optimizer_index].param_groups[entry.group_index]
            out[entry.fqn] = {k: _json_value(v) for k, v in group.items() if k != "params"}
        return out

    def snapshot(self) -> SnapshotHandle:
        """Snapshot the last committed step on the server; returns once it is consistent.

        Call between steps (after ``step()``). The trainer may step again at once; the
        handle's ``wait_durable()`` says when it is on disk.
        """
        step = self.session.last_committed_step
        if step is None:
            step = self._publish_step()
        metadata = self.snapshot_metadata()
        try:
            reply = self.session.snapshot(step, metadata)
        except SnapshotBusyError:
            # The server persists one snapshot of a segment at a time: a previous one (this
            # trainer's, or a restarted trainer's predecessor's) may still be persisting. Wait
            # for it and try once more; any other refusal comes back as it is.
            self._wait_for_persisting_snapshot(f"snapshot of step {step}")
            reply = self.session.snapshot(step, metadata)
        handle = SnapshotHandle(reply.snapshot_id, step, self.session.rank, self.client)
        self._snapshot_step, self._snapshot_handle = step, handle
        return handle

    def _snapshot_handle_for(self, snapshot_id: str) -> SnapshotHandle | None:
        """A handle on ``<job>/step-<N>`` for this rank (None for other forms, e.g. latest)."""
        job, _, step = snapshot_id.rpartition("/step-")
        if not job or not step.isdigit():
            return None
        return SnapshotHandle(snapshot_id, int(step), self.session.rank, self.client)

    def _wait_for_persisting_snapshot(self, why: str) -> None:
        """If the snapshot this segment's header names (``SNAP_STEP``) is still persisting,
        wait until it is durable or failed (bounded by ``backpressure_timeout_s``; logged)."""
        snap_step = self._mapping.header[Word.SNAP_STEP]
        previous = self._snapshot_handle_for(f"{self.remote_config.job_id}/step-{snap_step}")
        try:
            status = previous.status()
        except SwapStateError:
            return  # no such snapshot
        if status.state != "persisting":
            return
        timeout_s = self.remote_config.backpressure_timeout_s
        begin = time.monotonic()
        log.warning(
            "%s waits for snapshot %s to finish persisting (%d of %d bytes written)",
            why, previous.snapshot_id, status.bytes_persisted, status.bytes_total,
        )  # fmt: skip
        while status.state == "persisting":
            remaining = begin + timeout_s - time.monotonic()
            if remaining <= 0:
                raise SwapStateError(
                    f"{why}: snapshot {previous.snapshot_id} is still persisting after "
                    f"{timeout_s:g} s ({status.bytes_persisted} of {status.bytes_total} bytes)"
                )
            status = previous.status(wait_s=min(remaining, 5.0))
        log.warning(
            "%s waited %.3f s for snapshot %s (%s)",
            why, time.monotonic() - begin, previous.snapshot_id, status.state,
        )  # fmt: skip

    def _wait_segment_released(self, why: str) -> None:
        """Wait (bounded, logged) until no snapshot reads this segment (``SNAP_EPOCH == 0``,
        the server's condition for writing into it)."""
        header = self._mapping.header
        if header[Word.SNAP_EPOCH] == 0:
            return
        timeout_s = self.remote_config.backpressure_timeout_s
        begin = time.monotonic()
        poll = 1e-3
        while header[Word.SNAP_EPOCH] != 0:
            if time.monotonic() - begin > timeout_s:
                raise SwapStateError(
                    f"{why}: the snapshot of step {header[Word.SNAP_STEP]} still reads this "
                    f"segment after {timeout_s:g} s"
                )
            time.sleep(poll)
            poll = min(poll * 2, 0.05)
        log.warning(
            "%s waited %.3f s for the snapshot of step %d to release the segment",
            why, time.monotonic() - begin, header[Word.SNAP_STEP],
        )  # fmt: skip

    def restore(self, snapshot_id: str = "latest") -> int:
        """Replace the moments and steps with a durable snapshot's; returns its step.

        The server verifies layout and checksums before it writes a byte; on a mismatch it
        raises and the current state is untouched. Call between steps.
        """
        # A snapshot of this segment still persisting (a killed predecessor's, say) may be the
        # newest: let it become durable first, so "latest" means it.
        self._wait_for_persisting_snapshot(f"restore of {snapshot_id}")
        self._wait_segment_released(f"restore of {snapshot_id}")
        reply = self.session.restore(snapshot_id)
        self._torn_step = None
        self._guard.end_write()
        self._apply_restored_metadata(reply.metadata_json)
        self._resume_from_segment()
        self.session.commit(reply.step)
        self.resumed_step = reply.step
        # The state is now that snapshot's: a state_dict() of this step refers to it (a new
        # snapshot of the step would copy the same bytes, or be refused as existing).
        self._snapshot_step = reply.step
        self._snapshot_handle = SnapshotHandle(reply.snapshot_id, reply.step, self.session.rank, self.client)
        log.info("restored %s (step %d)", reply.snapshot_id, reply.step)
        return reply.step

    def _resume_from_segment(self) -> None:
        group_steps = self._views[GROUP_STEPS]
        for index, group in enumerate(g for o in self.optimizers for g in o.param_groups):
            group[STEP_KEY] = group_steps[index].clone()

    def _apply_restored_metadata(self, metadata_json: str) -> None:
        if not metadata_json:
            return
        groups = json.loads(metadata_json).get("param_groups", {})
        for entry in self._entries:
            saved = groups.get(entry.fqn)
            if not saved:
                continue
            group = self.optimizers[entry.optimizer_index].param_groups[entry.group_index]
            for key, value in saved.items():
                if key != STEP_KEY and key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value

    # -- torchtitan checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Seed format in 'full' mode. In 'snapshot' mode: a reference to a server-side
        snapshot of the last committed step (taken now, unless one of that step exists),
        plus param groups and step counts; no moment bytes pass through the trainer.

        Safe as a load template: a container that has committed no step (or whose kept state
        is torn) takes no snapshot; one that has (a reattached trainer) takes one, and the
        load then restores the referenced snapshot after it. In 'full' mode the returned
        moments are views that DCP loads into, so a snapshot still reading the segment is
        waited for first.
        """
        if self.remote_config.checkpoint != "snapshot":
            # The moments are views of the segment, and DCP loads *into* a template's tensors:
            # no write may land under a snapshot still reading the segment (a restarted
            # trainer's predecessor's, say), so such a snapshot's read is waited for first.
            self._wait_segment_released("state_dict()")
            return super().state_dict()
        flat = {k: v for k, v in super().state_dict().items() if not _is_moment_key(k)}
        step = self.session.last_committed_step
        if self._torn_step is not None:
            step = None  # no consistent state to refer to (a load template, before a restore)
        if step is not None and step != getattr(self, "_snapshot_step", None):
            self.snapshot()  # sets _snapshot_step and _snapshot_handle
        handle = getattr(self, "_snapshot_handle", None)
        flat[SNAPSHOT_REF_KEY] = handle.snapshot_id if handle is not None else ""
        flat[SNAPSHOT_JOB_KEY] = self.remote_config.job_id
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A snapshot reference is restored on the server (verified before any byte
        changes); a full dict goes through the seed's validated load."""
        snapshot_id = state_dict.get(SNAPSHOT_REF_KEY)
        if snapshot_id is None:
            torn, self._torn_step = self._torn_step, None  # a full load rewrites every byte
            try:
                super().load_state_dict(state_dict)
            except BaseException:
                self._torn_step = torn
                raise
            return
        if not snapshot_id:
            return  # saved before the first committed step: nothing to restore
        snapshot_id = str(snapshot_id)
        # The reference was saved once its snapshot was consistent; it may not be durable yet
        # (a save, then at once a load): wait for it, or for its failure.
        pending = self._snapshot_handle_for(snapshot_id)
        if pending is not None:
            try:
                pending.wait_durable(timeout_s=self.remote_config.backpressure_timeout_s)
            except NotFoundError:
                pass  # not (or no longer) known to the server: Restore says where it looked
        self.restore(snapshot_id)
        groups = {k: v for k, v in state_dict.items() if k.startswith("param_groups.")}
        for entry in self._entries:
            group = self.optimizers[entry.optimizer_index].param_groups[entry.group_index]
            prefix = f"param_groups.{entry.fqn}."
            for key, value in groups.items():
                name = key[len(prefix) :]
                if key.startswith(prefix) and name not in ("params", STEP_KEY) and name in group:
                    group[name] = value

    # -- lifetime ----------------------------------------------------------------------------
    def server_stats(self):
        return self.client.stats()

    def close(self, keep: bool = False) -> None:
        """Detach from the server (freeing the segment unless ``keep``), unmap, stop an
        embedded server. Idempotent; also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        try:
            if getattr(self, "session", None) is not None:
                try:
                    self.session.close(keep=keep)
                except SwapStateError as e:
                    log.warning("detach failed: %s", e)
        finally:
            self._release_mapping()
            if getattr(self, "client", None) is not None:
                self.client.close()
            if self._embedded is not None:
                self._embedded.stop()

    def _release_mapping(self) -> None:
        if self._mapping is None:
            return
        # Drop every reference to the views before unmapping.
        self.param_to_cpu_states_map.clear()
        self._views = {}
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        self._mapping.close()
        self._mapping = None


def _is_moment_key(key: str) -> bool:
    return key.startswith("state.") and not key.endswith("." + STEP_KEY)


def _close_at_exit(ref: weakref.ref) -> None:
    container = ref()
    if container is not None:
        container.close(keep=True)


def _dtensor_layout(param: Any) -> dict[str, list[int]]:
    if not isinstance(param, DTensor):
        return {}
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return {"global_shape": list(param.shape), "global_offset": [int(o) for o in offset]}


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"__tensor__": float(value), "dtype": dtype_name(value.dtype)}
    if isinstance(value, tuple):
        return list(value)
    return value
