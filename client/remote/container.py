"""``RemoteSwapOptimizersContainer``: the swap optimizer with its host cache in the host's
swap-state-server: the in-process container (same checkpoint contract) whose host cache is
views on a :class:`~swap_state.client.remote.remote_segment.RemoteSegment`.

Call order::

    c = RemoteSwapOptimizersContainer(model_parts, torch.optim.AdamW, kwargs, 8,
                                      server="unix:///run/swap-state/swap-state.sock", job_id="run1")
    loss.backward(); c.step(); c.zero_grad()    # per step; no RPC: the commit is a header word
    c.snapshot()                                 # between steps; one RPC, returns when consistent
    c.close()                                    # detach (also at interpreter exit)

Checkpoint modes (``RemoteConfig.checkpoint``): 'full', the seed's flat dict with the moments;
'snapshot', a reference to a server-side snapshot (:data:`SNAPSHOT_REF_KEY`) plus param groups
and steps. A load follows the dict (a reference or not), not the mode.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.errors import (
    NotFoundError, ServerUnavailableError, SnapshotFailedError, SnapshotNotFoundError, SwapStateError)
from swap_state.client.optim.checkpoint_template import SNAPSHOT_JOB_KEY, SNAPSHOT_REF_KEY, holds_snapshot_reference
from swap_state.client.optim.container import SwapOptimizersContainer
from swap_state.client.optim.dtensor_utils import global_layout
from swap_state.client.optim.host_cache import STEP_KEY, HostCacheEntry
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES
from swap_state.client.remote.config import RemoteConfig, follow_checkpoint_retention, resolve_config
from swap_state.client.remote.model_area import ModelArea
from swap_state.client.remote.remote_segment import GROUP_STEPS, PARAM_STEPS, RemoteSegment
from swap_state.client.remote.rpc import SnapshotHandle
from swap_state.client.remote.segment_mapping import dtype_name
from swap_state.common.names import STATE_PREFIX, is_model_tensor, param_group_key, state_key
from swap_state.common.sizing import plan_for_rank
from swap_state.common.snapshot_metadata import (
    TENSOR_TAG, TensorMetadata, encode_metadata, parse_metadata, tagged_scalar)
from swap_state.common.snapshot_metadata_parts import base_id, encode_base, encode_delta

__all__ = [
    "GROUP_STEPS", "PARAM_STEPS", "SNAPSHOT_JOB_KEY", "SNAPSHOT_REF_KEY", "RemoteConfig",
    "RemoteSwapOptimizersContainer", "SnapshotHandle", "is_moment_key"]

log = logging.getLogger("swap_state.client.remote_container")  # the name users configure


class RemoteSwapOptimizersContainer(SwapOptimizersContainer):
    """Swap optimizer whose host cache lives in swap-state-server's shared memory."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type[Optimizer], optimizer_kwargs: dict[str, Any],
                 swap_optimizer_times: int = DEFAULT_SWAP_TIMES, *, server: str | None = None,
                 job_id: str | None = None, config: RemoteConfig | None = None, **container_kwargs: Any) -> None:
        self.remote_config = resolve_config(config, server, job_id)
        self.segment = RemoteSegment(self.remote_config, model_parts, optimizer_kwargs)
        self._metadata: OptimizerMetadata | None = None
        self._fresh_group_steps: tuple[Any, ...] = ()
        self._checkpoint_snapshot: SnapshotHandle | None = None  # the last checkpoint's reference
        self._restored_reference: str | None = None  # the reference restored from, until the next step
        try:
            super().__init__(model_parts, optimizer_cls, optimizer_kwargs, swap_optimizer_times, **container_kwargs)
            # Fresh group steps are what a dropped state gets; a reattach's come from the segment.
            groups = all_param_groups(self.optimizers)
            self._fresh_group_steps = tuple(_clone(g.get(STEP_KEY)) for g in groups)
            if self.segment.resumed_step is not None:
                self._load_group_steps_from_segment()
        except BaseException:
            self.close()
            raise
        atexit.register(_close_at_exit, weakref.ref(self), os.getpid())

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

    def _allocate_host_cache(self, entries: Sequence[HostCacheEntry]) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """One Allocate RPC for every moment, the per-param steps and the group steps."""
        n_groups = sum(len(o.param_groups) for o in self.optimizers)
        specs = [(PARAM_STEPS, "float32", [len(entries)]), (GROUP_STEPS, "float32", [n_groups])]
        specs += [(state_key(e.fqn, k), dtype_name(e.dtype), list(e.shape)) for e in entries for k in e.keys]
        views = self.segment.allocate(specs, self.device_backend, [entry.param for entry in entries])
        self._log_sizing(entries)
        self._tensor_names: dict[torch.Tensor, list[str]] = {}
        cache: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        param_steps = views[PARAM_STEPS]
        for index, entry in enumerate(entries):
            names = [state_key(entry.fqn, key) for key in entry.keys]
            cache[entry.param] = {key: views[n] for key, n in zip(entry.keys, names)}
            cache[entry.param][STEP_KEY] = param_steps[index]
            self._tensor_names[entry.param] = names
        self._metadata = OptimizerMetadata(entries, self.optimizers, self.segment.model_area)
        return cache

    def _log_sizing(self, entries: Sequence[HostCacheEntry]) -> None:
        """What this rank's segment holds and a host of the job's ranks needs (``swap-state plan``)."""
        tensors = self.segment.mapping.tensors
        model = sum(t.nbytes for t in tensors if is_model_tensor(t.name))
        moments = sum(t.nbytes for t in tensors if t.name.startswith(STATE_PREFIX))
        params = sum(math.prod(entry.shape) for entry in entries)
        plan = plan_for_rank(params, moments, model, self.session.local_world_size, snapshots=bool(model))
        log.info("swap-state segment of job %s rank %d: %s; %s", self.remote_config.job_id, self.session.rank,
                 plan.lines()[0].removeprefix("per rank:").strip(), plan.lines()[2].removeprefix("server:").strip())

    def _before_host_write(self, params: Sequence[torch.Tensor]) -> None:
        self.segment.check_not_torn()
        # The step tensors change with every slice; the names are lazy: walked only while a
        # snapshot persists.
        names_of = self._tensor_names
        names = itertools.chain((PARAM_STEPS, GROUP_STEPS), (n for p in params for n in names_of.get(p, ())))
        self.segment.mapping.before_write(self._current_step(), names)

    def _current_step(self) -> int:
        steps = [g[STEP_KEY] for g in all_param_groups(self.optimizers) if STEP_KEY in g]
        return int(max((float(s) for s in steps), default=0))

    def _publish_step(self, params_known: bool = True) -> int:
        group_steps = self.segment.views[GROUP_STEPS]
        for index, group in enumerate(all_param_groups(self.optimizers)):
            group_steps[index] = float(group.get(STEP_KEY, 0))
        return self.segment.publish(self._current_step(), params_known)

    def _swap_step(self, optim: Optimizer, closure: Any = None) -> Any:
        self._verify_kept_state()  # first step after a reattach: is the kept state ours?
        if self.segment.model_area is not None:
            self.segment.model_area.wait_copy()  # the copy of the last step has read the parameters
        return super()._swap_step(optim, closure)

    def _after_step(self) -> None:
        self._restored_reference = None
        self._publish_step()  # the model is copied only for a snapshot

    def _after_load_state_dict(self) -> None:
        self.segment.mapping.before_write(self._current_step(), [GROUP_STEPS])
        self.segment.state_replaced()
        if self.segment.model_area is not None:
            # The model is loaded after the optimizer, if at all: the next snapshot copies it first.
            self.segment.model_area.copied_step = None
        self._publish_step(params_known=False)  # the model may be loaded after the optimizer

    def _verify_kept_state(self) -> None:
        """First step after a reattach: a dropped state's group steps become a fresh container's."""
        if self.segment.verify_kept_state():
            return
        for group, step in zip(all_param_groups(self.optimizers), self._fresh_group_steps):
            if step is None:
                group.pop(STEP_KEY, None)
            else:
                group[STEP_KEY] = _clone(step)

    def _load_group_steps_from_segment(self) -> None:
        group_steps = self.segment.views[GROUP_STEPS]
        for index, group in enumerate(all_param_groups(self.optimizers)):
            group[STEP_KEY] = group_steps[index].clone()

    def snapshot(self) -> SnapshotHandle:
        """Snapshot the last committed step on the server (between steps); returns once it is
        consistent. A whole-state snapshot's model copy lands after (the next update waits). A
        server restart is ridden through (``RemoteConfig.server_wait_s``), else
        ServerUnavailableError: training may go on and snapshot later."""
        self._verify_kept_state()
        step = self.session.last_committed_step
        if step is None:
            step = self._publish_step()
        return self.segment.snapshot(step, self._metadata.parts(self.segment.views[PARAM_STEPS]))

    def restore(self, snapshot_id: str = "latest") -> int:
        """Replace the moments and steps with a durable snapshot's (server-verified); its step."""
        return self.segment.restore(snapshot_id, self.snapshot_metadata(), self._apply_restored_metadata)

    def _apply_restored_metadata(self, metadata_json: str) -> None:
        views, tensors = self.segment.views, self.segment.mapping.tensors
        self._metadata.apply_restored(metadata_json, tensors, views[PARAM_STEPS], views[GROUP_STEPS])
        self._load_group_steps_from_segment()

    def snapshot_metadata(self) -> str:
        """What the server cannot know: fqns, keys, DTensor layout, param groups, steps."""
        return self._metadata.whole(self.segment.views[PARAM_STEPS])

    def follow_checkpoint_retention(self, keep_latest_k: int) -> None:
        """This job's snapshots follow its checkpoint retention (``keep_latest_k``)."""
        follow_checkpoint_retention(self.remote_config, keep_latest_k)

    def state_dict(self) -> dict[str, Any]:
        """Seed format in 'full' mode; in 'snapshot' mode a reference to a snapshot of the last
        committed step (taken now unless one exists) plus param groups and steps. While a load
        announced the checkpoint's keys, that checkpoint's template (no snapshot taken)."""
        held = self._loading_keys
        template = held is not None and holds_snapshot_reference(held)  # no snapshot taken
        if not template and (held is not None or self.remote_config.checkpoint != "snapshot"):
            # DCP loads into the template's views: no write under a snapshot still reading them.
            self.segment.wait_released("state_dict()")
            return super().state_dict()  # matched to the checkpoint's keys while loading
        flat = {} if self.snapshots_model and not template else {
            k: v for k, v in super().state_dict().items()
            if not is_moment_key(k) and (held is None or k in held)}
        flat[SNAPSHOT_REF_KEY] = "" if template else self.checkpoint_reference()
        flat[SNAPSHOT_JOB_KEY] = self.remote_config.job_id
        return flat

    def checkpoint_reference(self) -> str:
        """The id of a snapshot of the last committed step, taken now unless one exists ("" with
        no committed step or torn state); returns once the model's copy has landed."""
        step, handle = self.session.last_committed_step, self.segment.snapshot_handle
        if step is not None and (handle is None or handle.step != step) and self.segment.torn_step is None:
            handle = self.snapshot()  # a restarting server is waited for (server_wait_s)
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
        return self.snapshots_model and self.remote_config.checkpoint == "snapshot"

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
        if snapshot_id and snapshot_id != self._restored_reference:
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
                    "load an earlier checkpoint (torchtitan: --checkpoint.load_step=<step>)"
                ) from e
        self.restore(snapshot_id)
        self._restored_reference = snapshot_id
        self._metadata.apply_saved_param_groups(state_dict)

    def wait_checkpoint_durable(self, timeout_s: float | None = None, stored: bool = False) -> None:
        """Block until the snapshot the last snapshot-mode ``state_dict()`` referred to is
        durable (``stored``: in the ``--snapshot-store`` too); raise if it failed. Call before
        the trainer exits: a detach ends a snapshot still persisting."""
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
        """Detach (freeing the segment unless ``keep``), unmap, stop an embedded server; idempotent."""
        if self.segment.closed:
            return
        try:
            self.wait_checkpoint_durable()
        except SwapStateError as e:
            log.warning("the snapshot the last checkpoint refers to is not durable: %s", e)
        # No view outlives the mapping (vars(): an __init__ that failed early set no map).
        vars(self).get("param_to_cpu_states_map", {}).clear()
        self.segment.close(keep)


class OptimizerMetadata:
    """What a snapshot's metadata says of the optimizers (fqns, moment keys, DTensor layout,
    param groups, steps: what the server cannot know), read when asked (groups and steps change):
    sent as a base built once plus a per-snapshot delta; a restore sends the layout whole and
    gets the snapshot's metadata back."""

    def __init__(self, entries: Sequence[HostCacheEntry], optimizers: Sequence[Optimizer],
                 model_area: ModelArea | None):
        self._entries = list(entries)
        self._optimizers = optimizers
        self._model_area = model_area
        self._base: tuple[str, str] | None = None  # (id, text): what no step changes

    def _tensors(self) -> dict[str, TensorMetadata]:
        tensors: dict[str, TensorMetadata] = {}
        for entry in self._entries:
            global_shape, global_offset = global_layout(entry.param) or (None, None)
            for key in entry.keys:
                tensors[state_key(entry.fqn, key)] = TensorMetadata(entry.fqn, key, global_shape, global_offset)
        if self._model_area is not None:
            tensors.update(self._model_area.metadata())
        return tensors

    def _aliases(self) -> dict[str, str] | None:
        return self._model_area.aliases() if self._model_area is not None else None

    def whole(self, param_steps: torch.Tensor) -> str:
        """The metadata as one JSON text (a restore's layout): tensors, groups, steps."""
        steps = {entry.fqn: float(param_steps[index]) for index, entry in enumerate(self._entries)}
        groups = {entry.fqn: _json_group(self._group_of(entry)) for entry in self._entries}
        return encode_metadata(self._tensors(), groups, steps, self._aliases())

    def parts(self, param_steps: torch.Tensor) -> tuple[str, str, str]:
        """(base id, base, delta), the base built once."""
        if self._base is None:
            offsets = group_offsets(self._optimizers)
            text = encode_base(self._tensors(), self._aliases(), [e.fqn for e in self._entries],
                               [offsets[e.optimizer_index] + e.group_index for e in self._entries])
            self._base = (base_id(text), text)
        groups = [_json_group(group) for group in all_param_groups(self._optimizers)]
        counts = param_steps  # the per-parameter steps are one tensor
        steps = float(counts[0]) if len(counts) and bool((counts == counts[0]).all()) else counts.tolist()
        return self._base[0], self._base[1], encode_delta(groups, steps)

    def _group_of(self, entry: HostCacheEntry) -> dict[str, Any]:
        return self._optimizers[entry.optimizer_index].param_groups[entry.group_index]

    def apply_restored(self, metadata_json: str, segment_tensors: Any,
                       param_steps: torch.Tensor, group_steps: torch.Tensor) -> None:
        """The snapshot's hyperparameters into the live groups, its steps into the bookkeeping
        tensors (a restore at another layout does not copy those; the metadata has them per fqn)."""
        if not metadata_json:
            return
        restored = parse_metadata(metadata_json, segment_tensors, max_bytes=sys.maxsize)
        offsets = group_offsets(self._optimizers)
        for index, entry in enumerate(self._entries):
            if entry.fqn in restored.steps:
                param_steps[index] = _step_value(restored.steps[entry.fqn])
            saved = restored.param_groups.get(entry.fqn)
            if not saved:
                continue
            group = self._group_of(entry)
            for key, value in saved.items():
                if key != STEP_KEY and key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
            if STEP_KEY in saved:
                group_steps[offsets[entry.optimizer_index] + entry.group_index] = _step_value(saved[STEP_KEY])

    def apply_saved_param_groups(self, state_dict: Mapping[str, Any]) -> None:
        """A checkpoint's hyperparameters (not ``params`` or ``step``) into the live groups."""
        for entry in self._entries:
            group = self._group_of(entry)
            for name in list(group):
                key = param_group_key(entry.fqn, name)
                if name not in ("params", STEP_KEY) and key in state_dict:
                    group[name] = state_dict[key]


def all_param_groups(optimizers: Sequence[Any]) -> list[dict[str, Any]]:
    """Every param group of every optimizer, in the segment's group-steps order."""
    return [g for o in optimizers for g in o.param_groups]


def json_value(value: Any) -> Any:
    """A hyperparameter in the metadata's JSON form: a 0-dim tensor tagged, a tuple a list."""
    if isinstance(value, torch.Tensor):
        return tagged_scalar(float(value), dtype_name(value.dtype))
    if isinstance(value, tuple):
        return list(value)
    return value


def _json_group(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: json_value(v) for k, v in group.items() if k != "params"}


def group_offsets(optimizers: Sequence[Any]) -> list[int]:
    """Where each optimizer's param groups start in the segment's group steps."""
    return list(itertools.accumulate((len(o.param_groups) for o in optimizers), initial=0))


def _step_value(value: Any) -> float:
    """A step count as the metadata holds it (a number, or a tagged 0-dim tensor)."""
    return float(value[TENSOR_TAG]) if isinstance(value, dict) else float(value)


def is_moment_key(key: str) -> bool:
    """A ``state.<fqn>.<moment>`` key (not a step): left out of a snapshot-mode dict."""
    return key.startswith(STATE_PREFIX) and not key.endswith("." + STEP_KEY)


def _clone(value: Any) -> Any:
    return value.clone() if hasattr(value, "clone") else value


def _close_at_exit(ref: weakref.ref, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child exiting: the container (session, server) is its parent's
    container = ref()
    if container is not None:
        container.close(keep=True)
