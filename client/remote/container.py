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
        loss.backward(); c.step(); c.zero_grad()    # no RPC: the commit is a header word
        if step % 100 == 0:
            c.snapshot()                             # one RPC; returns when consistent
    c.close()                                        # detach (also at interpreter exit)

The modules behind it:

- :mod:`~swap_state.client.remote.config`: RemoteConfig, environment, server / embedded
- :mod:`~swap_state.client.remote.reattach`: reattach to a kept segment, torn state
- :mod:`~swap_state.client.remote.snapshots`: SnapshotHandle, snapshot / restore / waits
- :mod:`~swap_state.client.remote.checkpoint`: 'full' vs 'snapshot' state_dict / load

Importing this module patches nothing in torchtitan.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import os
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.remote.embedded import EmbeddedServer
from swap_state.client.errors import ServerUnavailableError, SwapStateError
from swap_state.client.optim.host_cache import STEP_KEY, HostCacheEntry
from swap_state.client.remote.checkpoint import SNAPSHOT_JOB_KEY, SNAPSHOT_REF_KEY, CheckpointMode
from swap_state.client.remote.model_area import ModelArea, plan_model_tensors
from swap_state.client.remote.config import RemoteConfig, connect, resolve_config, snapshots_model
from swap_state.client.remote.reattach import GROUP_STEPS, PARAM_STEPS, ReattachCheck, all_param_groups
from swap_state.client.remote.snapshots import SnapshotClient, SnapshotHandle
from swap_state.client.remote.rpc import RemoteSession
from swap_state.client.remote.segment_mapping import SegmentMapping, dtype_name
from swap_state.client.remote.snapshot_guard import SnapshotGuard
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.optim.container import SwapOptimizersContainer
from swap_state.common.names import STATE_PREFIX, is_model_tensor, state_key
from swap_state.common.sizing import plan_for_rank

__all__ = [
    "GROUP_STEPS",
    "PARAM_STEPS",
    "SNAPSHOT_JOB_KEY",
    "SNAPSHOT_REF_KEY",
    "RemoteConfig",
    "RemoteSwapOptimizersContainer",
    "SnapshotHandle",
]

log = logging.getLogger("swap_state.client.remote_container")  # the name users configure


class RemoteSwapOptimizersContainer(SwapOptimizersContainer):
    """Swap optimizer whose host cache lives in swap-state-server's shared memory.

    It holds, besides the in-process container's parts, one object per remote job: the
    reattach check (:class:`~swap_state.client.remote.reattach.ReattachCheck`: torn state,
    the resumed step, the fingerprint), the snapshot client
    (:class:`~swap_state.client.remote.snapshots.SnapshotClient`), the checkpoint mode
    (:class:`~swap_state.client.remote.checkpoint.CheckpointMode`) and, with whole-state
    snapshots, the model area. It overrides the in-process container's hooks, not its parts.
    """

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
        self.remote_config = resolve_config(config, server, job_id)
        self._embedded: EmbeddedServer | None = None
        self._mapping: SegmentMapping | None = None
        self._guard: SnapshotGuard | None = None
        self._model_area: ModelArea | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._closed = False
        self._reattach = ReattachCheck(self)
        self._snapshots = SnapshotClient(self)
        self._checkpoint = CheckpointMode(self)
        self.session = self._connect(model_parts, optimizer_kwargs)
        self.resumed_step = None
        try:
            super().__init__(model_parts, optimizer_cls, optimizer_kwargs, swap_optimizer_times, **container_kwargs)
            self._resume_group_steps()
        except BaseException:
            self.close()
            raise
        # close() at exit without keeping the container alive
        atexit.register(_close_at_exit, weakref.ref(self), os.getpid())

    def _connect(self, model_parts: Sequence[nn.Module], kwargs: dict[str, Any]) -> RemoteSession:
        """Attach (starting an embedded server when no address is configured)."""
        connection = connect(self.remote_config, model_parts, kwargs)
        self.client, self._embedded = connection.client, connection.embedded
        return connection.session

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
                (state_key(entry.fqn, key), dtype_name(entry.dtype), list(entry.shape)) for key in entry.keys
            )
        model_tensors = []
        if snapshots_model(self.remote_config):
            model_tensors = plan_model_tensors(
                self.model_parts, [e.param for e in entries], self.remote_config.model_state_dict
            )
            specs.extend(t.spec() for t in model_tensors)  # last: protocol step 5
        reply = self.session.allocate(specs)
        self._log_sizing(reply.segment, entries)
        self._mapping = SegmentMapping.open(reply.segment)
        self._mapping.register_for_dma(self._backend)
        self._views = self._mapping.tensor_views()
        self.session.bind_header(self._mapping.trainer)
        self._check_resumable(reply.reused)
        self._guard = SnapshotGuard(self._mapping, self.remote_config.backpressure_timeout_s,
                                    server_gone=self.session.server_gone)
        if model_tensors:
            self._model_area = ModelArea(
                model_tensors, self._views, self._guard, self._mapping.trainer, self._backend,
                model_parts=self.model_parts, state_dict_of=self.remote_config.model_state_dict,
            )  # fmt: skip
        self._tensor_names: dict[torch.Tensor, list[str]] = {}
        cache: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        param_steps = self._views[PARAM_STEPS]
        for index, entry in enumerate(entries):
            names = [state_key(entry.fqn, key) for key in entry.keys]
            cache[entry.param] = {key: self._views[n] for key, n in zip(entry.keys, names)}
            cache[entry.param][STEP_KEY] = param_steps[index]
            self._tensor_names[entry.param] = names
        self._entries = list(entries)
        return cache

    def _log_sizing(self, segment, entries: Sequence[HostCacheEntry]) -> None:
        """What this rank's segment holds and what a host of the job's ranks needs (the
        numbers of ``swap-state plan``)."""
        model = sum(t.nbytes for t in segment.tensors if is_model_tensor(t.name))
        moments = sum(t.nbytes for t in segment.tensors if t.name.startswith(STATE_PREFIX))
        params = sum(math.prod(entry.shape) for entry in entries)
        plan = plan_for_rank(params, moments, model, self.session.local_world_size, snapshots=bool(model))
        log.info("swap-state segment of job %s rank %d: %s; %s", self.remote_config.job_id, self.session.rank,
                 plan.lines()[0].removeprefix("per rank:").strip(), plan.lines()[2].removeprefix("server:").strip())

    def _before_host_write(self, params: Sequence[torch.Tensor]) -> None:
        self._check_not_torn()
        # The step tensors change with every slice, so they are guarded every time. The
        # names are an iterator the guard walks only while a snapshot persists: a step
        # without one looks up no parameter here.
        names_of = self._tensor_names
        names = itertools.chain((PARAM_STEPS, GROUP_STEPS), (n for p in params for n in names_of.get(p, ())))
        self._guard.before_write(self._current_step(), names)

    def _current_step(self) -> int:
        steps = [g[STEP_KEY] for g in all_param_groups(self.optimizers) if STEP_KEY in g]
        return int(max((float(s) for s in steps), default=0))

    def _publish_step(self, params_known: bool = True) -> int:
        """Group steps and the parameters' fingerprint into the segment, clear the writing
        mark, commit (header words, no RPC): in that order."""
        step = self._current_step()
        group_steps = self._views[GROUP_STEPS]
        for index, group in enumerate(all_param_groups(self.optimizers)):
            group_steps[index] = float(group.get(STEP_KEY, 0))
        if params_known:
            self._write_fingerprint()
        self._guard.end_write()
        self.session.commit(step)
        return step

    def _swap_step(self, optim: Optimizer, closure: Any = None) -> Any:
        self._verify_kept_state()  # first step after a reattach: is the kept state ours?
        if self._model_area is not None:
            self._model_area.wait_copy()  # the copy of the last step has read the parameters
        return super()._swap_step(optim, closure)

    def _after_step(self) -> None:
        self._restored_reference = None
        self._publish_step()  # the model is copied only for a snapshot (SnapshotClient.snapshot)

    def _after_load_state_dict(self) -> None:
        self._guard.before_write(self._current_step(), [GROUP_STEPS])
        self._state_replaced()
        if self._model_area is not None:
            self._model_area.invalidate()  # the model is loaded after the optimizer, if at all
        self._publish_step(params_known=False)  # the model may be loaded after the optimizer

    # -- state owned by the parts, read by the others -------------------------------------
    @property
    def resumed_step(self) -> int | None:
        """The step a reattach (or a restore) resumed at; None for a fresh segment."""
        return self._reattach.resumed_step

    @resumed_step.setter
    def resumed_step(self, step: int | None) -> None:
        self._reattach.resumed_step = step

    @property
    def _torn_step(self) -> int | None:
        return self._reattach._torn_step

    @_torn_step.setter
    def _torn_step(self, step: int | None) -> None:
        self._reattach._torn_step = step

    @property
    def _snapshot_step(self) -> int | None:
        return self._snapshots._snapshot_step

    @property
    def _snapshot_handle(self) -> SnapshotHandle | None:
        return self._snapshots._snapshot_handle

    @property
    def _checkpoint_snapshot(self) -> SnapshotHandle | None:
        return self._checkpoint._checkpoint_snapshot

    @property
    def _restored_reference(self) -> str | None:
        return self._checkpoint._restored_reference

    @_restored_reference.setter
    def _restored_reference(self, reference: str | None) -> None:
        self._checkpoint._restored_reference = reference

    # -- reattach (ReattachCheck) -----------------------------------------------------------
    def _check_resumable(self, reused: bool) -> None:
        self._reattach._check_resumable(reused)

    def _check_not_torn(self) -> None:
        self._reattach._check_not_torn()

    def _resume_group_steps(self) -> None:
        self._reattach._resume_group_steps()

    def _state_replaced(self) -> None:
        self._reattach._state_replaced()

    def _write_fingerprint(self) -> None:
        self._reattach._write_fingerprint()

    def _verify_kept_state(self) -> None:
        self._reattach._verify_kept_state()

    def _load_group_steps_from_segment(self) -> None:
        self._reattach._load_group_steps_from_segment()

    # -- snapshots (SnapshotClient) ------------------------------------------------------------
    def snapshot(self) -> SnapshotHandle:
        """Snapshot the last committed step on the server; returns once it is consistent."""
        return self._snapshots.snapshot()

    def restore(self, snapshot_id: str = "latest") -> int:
        """Replace the moments and steps with a durable snapshot's; returns its step."""
        self._state_replaced()  # first: a trainer killed mid-restore leaves nothing to trust
        return self._snapshots.restore(snapshot_id)

    def snapshot_metadata(self) -> str:
        return self._snapshots.snapshot_metadata()

    def state_dict_param_groups(self) -> dict[str, dict[str, Any]]:
        return self._snapshots.state_dict_param_groups()

    def snapshot_retention(self) -> dict[str, Any]:
        return self._snapshots.snapshot_retention()

    def follow_checkpoint_retention(self, keep_latest_k: int) -> None:
        self._snapshots.follow_checkpoint_retention(keep_latest_k)

    def snapshot_location(self) -> str:
        return self._snapshots.snapshot_location()

    def _snapshot_handle_for(self, snapshot_id: str) -> SnapshotHandle | None:
        return self._snapshots._snapshot_handle_for(snapshot_id)

    def _wait_for_persisting_snapshot(self, why: str) -> None:
        self._snapshots._wait_for_persisting_snapshot(why)

    def _wait_segment_released(self, why: str) -> None:
        self._snapshots._wait_segment_released(why)

    # -- checkpoints (CheckpointMode) ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint mode's dict (:meth:`CheckpointMode.state_dict`)."""
        return self._checkpoint.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A snapshot reference is restored on the server; a full dict is the seed's load."""
        self._checkpoint.load_state_dict(state_dict)

    def _full_state_dict(self) -> dict[str, Any]:
        """The in-process container's (the seed's) flat state dict."""
        return super().state_dict()

    def _full_load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The in-process container's (the seed's) validated load."""
        super().load_state_dict(state_dict)

    def checkpoint_reference(self) -> str:
        return self._checkpoint.checkpoint_reference()

    @property
    def snapshots_model(self) -> bool:
        return self._checkpoint.snapshots_model

    @property
    def whole_state_checkpoints(self) -> bool:
        return self._checkpoint.whole_state_checkpoints

    def restore_reference(self, snapshot_id: str) -> None:
        self._checkpoint.restore_reference(snapshot_id)

    def wait_checkpoint_durable(self, timeout_s: float | None = None) -> None:
        self._checkpoint.wait_checkpoint_durable(timeout_s)

    def wait_checkpoint_stored(self, timeout_s: float | None = None) -> None:
        """Until the snapshot the last snapshot-mode checkpoint refers to is in the server's
        ``--snapshot-store`` (every host reaches it): a lost host no longer loses it."""
        self._checkpoint.wait_checkpoint_durable(timeout_s, stored=True)

    # -- lifetime ----------------------------------------------------------------------------
    def server_stats(self, wait_s: float = 0.0):
        """The server's Stats reply. A server that does not answer (restarting) is waited for
        up to ``wait_s``: until the session has reconnected to it, then asked again."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.client.stats()
            except ServerUnavailableError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self.session.wait_connected(left)  # returns at once until the outage is seen
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def close(self, keep: bool = False) -> None:
        """Detach from the server (freeing the segment unless ``keep``), unmap, stop an
        embedded server. Idempotent; also run at interpreter exit."""
        if self._closed:
            return
        try:
            # A checkpoint may refer to a snapshot still persisting; detaching (or stopping
            # the embedded server) would end it.
            self.wait_checkpoint_durable()
        except SwapStateError as e:
            log.warning("the snapshot the last checkpoint refers to is not durable: %s", e)
        self._closed = True
        # Every part runs even when one fails (last pushed, first run); the first failure is
        # raised after all of them.
        with contextlib.ExitStack() as parts:
            if self._embedded is not None:
                parts.callback(self._embedded.stop)
            if getattr(self, "client", None) is not None:
                parts.callback(self.client.close)
            parts.callback(self._release_mapping)
            if getattr(self, "session", None) is not None:
                parts.callback(self._detach, keep)

    def _detach(self, keep: bool) -> None:
        try:
            self.session.close(keep=keep)
        except SwapStateError as e:
            log.warning("detach failed: %s", e)

    def _release_mapping(self) -> None:
        if self._mapping is None:
            return
        # Drop every reference to the views before unmapping.
        if getattr(self, "session", None) is not None:
            self.session.bind_header(None)
        self.param_to_cpu_states_map.clear()
        self._views = {}
        if self._model_area is not None:
            self._model_area.close()
            self._model_area = None
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        try:
            self.device_backend.synchronize()  # no copy in flight from or to the mapping
        finally:
            self._mapping.close()  # unregisters it for DMA, then unmaps
            self._mapping = None


def _close_at_exit(ref: weakref.ref, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child exiting: the container (session, server) is its parent's
    container = ref()
    if container is not None:
        container.close(keep=True)
