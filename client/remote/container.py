"""``RemoteSwapOptimizersContainer``: the in-process swap container (same checkpoint contract)
whose host cache is views on the host's swap-state-server segment. Call order::

    c = RemoteSwapOptimizersContainer(model_parts, torch.optim.AdamW, kwargs, 8,
                                      server="unix:///run/swap-state/swap-state.sock", job_id="run1")
    loss.backward(); c.step(); c.zero_grad()    # per step; no RPC: the commit is a header word
    c.snapshot()                                 # between steps; one RPC, returns when consistent
    c.close()                                    # detach (also at interpreter exit)

A load follows the dict (a snapshot reference or the moments), not ``RemoteConfig.checkpoint``.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.device import get_device_backend
from swap_state.client.errors import NotFoundError, SnapshotFailedError, SnapshotNotFoundError, SwapStateError
from swap_state.client.optim.checkpoint_template import SNAPSHOT_JOB_KEY, SNAPSHOT_REF_KEY, holds_snapshot_reference
from swap_state.client.optim.container import SwapOptimizersContainer
from swap_state.client.optim.host_cache import STEP_KEY
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.remote.config import CheckpointMode, RemoteConfig, follow_checkpoint_retention, resolve_config
from swap_state.client.remote.remote_segment import GROUP_STEPS, PARAM_STEPS, RemoteSegment
from swap_state.client.remote.rpc import SnapshotHandle
from swap_state.client.remote.segment_store import SegmentStore
from swap_state.common.names import STATE_PREFIX
from swap_state.common.segment import Word

__all__ = [
    "GROUP_STEPS", "PARAM_STEPS", "SNAPSHOT_JOB_KEY", "SNAPSHOT_REF_KEY", "RemoteConfig",
    "RemoteSwapOptimizersContainer", "SnapshotHandle", "is_moment_key"]

log = logging.getLogger(__name__)


class RemoteSwapOptimizersContainer(SwapOptimizersContainer):
    """The swap container over the host's swap-state-server: its moment store is the
    server's segment (:class:`SegmentStore`), and it snapshots and restores there.

    Args:
        model_parts, optimizer_cls, optimizer_kwargs, swap_optimizer_times: as
            :class:`~swap_state.client.optim.container.SwapOptimizersContainer`'s.
        server: the server's address (``unix:///path`` or ``tcp://host:port``); None: the
            config's, else ``$SWAP_STATE_SERVER``, else the host's, else an embedded server.
        job_id: the job's id, shared by its ranks (None: the config's or ``$SWAP_STATE_JOB_ID``).
        config: :class:`RemoteConfig` (checkpoint mode, timeouts, embedded server, ...).
        container_kwargs: the in-process container's keyword arguments (``store`` aside).
    """

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type[Optimizer], optimizer_kwargs: dict[str, Any],
                 swap_optimizer_times: int = DEFAULT_SWAP_TIMES, *, server: str | None = None,
                 job_id: str | None = None, config: RemoteConfig | None = None, **container_kwargs: Any) -> None:
        self.remote_config = resolve_config(config, server, job_id)
        self.segment = RemoteSegment(self.remote_config, model_parts, optimizer_kwargs)
        self._checkpoint_snapshot: SnapshotHandle | None = None  # the last checkpoint's reference
        try:
            backend = container_kwargs.pop("device_backend", None) or get_device_backend()
            super().__init__(model_parts, optimizer_cls, optimizer_kwargs, swap_optimizer_times,
                             device_backend=backend, store=SegmentStore(self.segment, backend), **container_kwargs)
        except BaseException:
            self.close()
            raise
        atexit.register(_close_at_exit, weakref.ref(self), os.getpid())

    store: SegmentStore

    @property
    def session(self) -> Any:
        """The attached session (:class:`~swap_state.client.remote.rpc.RemoteSession`)."""
        return self.segment.session

    @property
    def client(self) -> Any:
        """The channel to the server (:class:`~swap_state.client.remote.rpc.SwapStateClient`)."""
        return self.segment.client

    @property
    def resumed_step(self) -> int | None:
        """The step a reattach (or a restore) resumed at; None for a fresh segment."""
        return self.segment.resumed_step

    def snapshot(self, memory_only: bool = False) -> SnapshotHandle:
        """Snapshot the last committed step on the server (between steps); returns once it is consistent. A whole-state
        snapshot's model copy lands after (the next update waits). A server restart is ridden through
        (``RemoteConfig.server_wait_s``), else ServerUnavailableError: training may go on and snapshot later.
        ``memory_only``: kept in the host's memory and a peer server's (``--replica-peers``), never on disk."""
        self.store.verify_kept_state()
        step = self.session.last_committed_step
        if step is None:
            step = self.store.publish_step()
        return self.segment.snapshot(step, self.store.metadata.parts(self.segment.views[PARAM_STEPS]), memory_only)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._replica_snapshot()
        super().step(*args, **kwargs)

    def _replica_snapshot(self) -> None:
        """``RemoteConfig.replica_interval``: a memory-only snapshot of the last committed step as the next begins
        (after any checkpoint of it); skipped while a snapshot reads the segment (training never waits for one)."""
        interval, step = self.remote_config.replica_interval, self.session.last_committed_step
        if not interval or not step or step % interval:
            return
        handle = self.segment.snapshot_handle
        if handle is not None and handle.step == step:
            return  # snapshotted already (a checkpoint, or this same step)
        if self.segment.mapping.header[Word.SNAP_EPOCH]:
            log.info("replica snapshot of step %d skipped: the previous snapshot still persists", step)
            return
        self.snapshot(memory_only=True)

    def restore(self, snapshot_id: str = "latest") -> int:
        """Replace the moments and steps with a durable snapshot's (server-verified); its step.
        ``snapshot_id``: ``"<job>/step-<N>"``, or ``"latest"``: the job's newest durable step (local,
        or in the ``--snapshot-store``), at this or another world size and layout."""
        return self.segment.restore(snapshot_id, self.snapshot_metadata(), self.store.apply_restored_metadata)

    def snapshot_metadata(self) -> str:
        """What the server cannot know: fqns, keys, DTensor layout, param groups, steps."""
        return self.store.metadata.whole(self.segment.views[PARAM_STEPS])

    def follow_checkpoint_retention(self, keep_latest_k: int) -> None:
        """This job's snapshots follow its checkpoint retention (``keep_latest_k``)."""
        follow_checkpoint_retention(self.remote_config, keep_latest_k)

    def state_dict(self) -> dict[str, Any]:
        """Seed format in 'full' mode; in 'snapshot' mode a reference to a snapshot of the last
        committed step (taken now unless one exists) plus param groups and steps. While a load
        announced the checkpoint's keys, that checkpoint's template (no snapshot taken)."""
        held = self._loading_keys
        template = held is not None and holds_snapshot_reference(held)  # no snapshot taken
        if not template and (held is not None or self.remote_config.checkpoint != CheckpointMode.SNAPSHOT):
            # DCP loads into the template's views: no write under a snapshot still reading them.
            self.segment.wait_released("state_dict()")
            return super().state_dict()  # matched to the checkpoint's keys while loading
        flat = {} if self.snapshots_model and not template else {
            k: v for k, v in super().state_dict().items()
            if not is_moment_key(k) and (held is None or k in held)}
        flat[SNAPSHOT_REF_KEY] = "" if template else self.checkpoint_reference()
        flat[SNAPSHOT_JOB_KEY] = self.remote_config.job_id
        return flat

    def checkpoint_reference(self, memory_only: bool = False) -> str:
        """The id of a snapshot of the last committed step, taken now unless one exists ("" with no committed step or
        torn state; ``memory_only``: see :meth:`snapshot`); returns once the model's copy has landed."""
        step, handle = self.session.last_committed_step, self.segment.snapshot_handle
        if step is not None and (handle is None or handle.step != step) and self.segment.torn_step is None:
            handle = self.snapshot(memory_only)  # a restarting server is waited for (server_wait_s)
        if self.snapshots_model:
            # A trainer killed once the save returns must leave a snapshot the server can complete.
            self.segment.model_area.wait_published()
        self._checkpoint_snapshot = handle
        return handle.snapshot_id if handle is not None else ""

    @property
    def snapshots_model(self) -> bool:
        """Whether the snapshots hold the model's parameters too (whole-state snapshots)."""
        return self.segment.model_area is not None

    @property
    def whole_state_checkpoints(self) -> bool:
        """Whether a checkpoint's model entry may be a reference too (snapshot mode, whole state)."""
        return self.snapshots_model and self.remote_config.checkpoint == CheckpointMode.SNAPSHOT

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """A snapshot reference is restored on the server; a full dict takes the seed's validated load."""
        snapshot_id = state_dict.get(SNAPSHOT_REF_KEY)
        if snapshot_id is not None:
            if snapshot_id:  # empty: saved before the first committed step, nothing to restore
                self._load_snapshot_reference(str(snapshot_id), state_dict)
            return
        torn, self.segment.torn_step = self.segment.torn_step, None
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            self.segment.torn_step = torn
            raise

    def restore_reference(self, snapshot_id: str) -> None:
        """Restore the snapshot a checkpoint refers to, unless the state already is that one's."""
        if snapshot_id and snapshot_id != self.store.restored_reference:
            self._load_snapshot_reference(snapshot_id, {})

    def _load_snapshot_reference(self, snapshot_id: str, state_dict: Mapping[str, Any]) -> None:
        """Wait for the snapshot to be durable (a save, then at once a load), restore it."""
        pending = self.segment.handle_for(snapshot_id)
        if pending is not None:
            try:
                pending.wait_durable(timeout_s=self.remote_config.backpressure_timeout_s)
            except (NotFoundError, SnapshotNotFoundError):
                pass  # not (or no longer) known to the server: Restore says where it looked
            except SnapshotFailedError as e:
                raise SnapshotFailedError(
                    f"the checkpoint refers to snapshot {snapshot_id}, which never completed ({e}); "
                    "load an earlier checkpoint (torchtitan: --checkpoint.load_step=<step>)") from e
        self.restore(snapshot_id)
        self.store.restored_reference = snapshot_id
        self.store.metadata.apply_saved_param_groups(state_dict)

    def wait_checkpoint_durable(self, timeout_s: float | None = None, stored: bool = False) -> None:
        """Block until the snapshot the last snapshot-mode ``state_dict()`` referred to is durable (``stored``: in the
        ``--snapshot-store`` too) for up to ``timeout_s`` (None: ``RemoteConfig.backpressure_timeout_s``); raise if it
        failed. Call before the trainer exits: a detach ends a snapshot still persisting."""
        handle = self._checkpoint_snapshot
        if handle is None or self.segment.closed:
            return
        timeout_s = self.remote_config.backpressure_timeout_s if timeout_s is None else timeout_s
        (handle.wait_stored if stored else handle.wait_durable)(timeout_s=timeout_s)

    def wait_checkpoint_stored(self, timeout_s: float | None = None) -> None:
        """Until the last snapshot-mode checkpoint's snapshot is in the ``--snapshot-store``."""
        self.wait_checkpoint_durable(timeout_s, stored=True)

    def server_stats(self, wait_s: float = 0.0):
        """The server's Stats reply; a restarting server is waited for up to ``wait_s``."""
        return self.client.stats(server_wait_s=wait_s)

    def close(self, keep: bool = False) -> None:
        """Detach, unmap, stop an embedded server; idempotent (also run at interpreter exit).
        ``keep``: keep the segment on the server for its ``--grace`` (a restarted trainer of this
        job and rank reattaches to it); False frees it now."""
        if self.segment.closed:
            return
        try:
            self.wait_checkpoint_durable()
        except SwapStateError as e:
            log.warning("the snapshot the last checkpoint refers to is not durable: %s", e)
        # No view outlives the mapping (vars(): an __init__ that failed early set no map).
        vars(self).get("param_to_cpu_states_map", {}).clear()
        self.segment.close(keep)


def is_moment_key(key: str) -> bool:
    """A ``state.<fqn>.<moment>`` key (not a step): left out of a snapshot-mode dict."""
    return key.startswith(STATE_PREFIX) and not key.endswith("." + STEP_KEY)


def _close_at_exit(ref: weakref.ref, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child exiting: the container (session, server) is its parent's
    container = ref()
    if container is not None:
        container.close(keep=True)
