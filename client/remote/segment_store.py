"""The remote container's moment store, the server's segment (:class:`SegmentStore`: each step
committed by header words, no RPC), and what a snapshot says of the optimizers
(:class:`OptimizerMetadata`).
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from swap_state.client.device import DeviceBackend
from swap_state.client.optim.dtensor_utils import global_layout
from swap_state.client.optim.host_cache import STEP_KEY, HostCacheEntry
from swap_state.client.remote.model_area import ModelArea
from swap_state.client.remote.remote_segment import GROUP_STEPS, PARAM_STEPS, RemoteSegment
from swap_state.client.remote.segment_mapping import dtype_name
from swap_state.common.names import STATE_PREFIX, is_model_tensor, param_group_key, state_key
from swap_state.common.sizing import plan_for_rank
from swap_state.common.snapshot_metadata import (
    TENSOR_TAG, TensorMetadata, encode_metadata, parse_metadata, tagged_scalar)
from swap_state.common.snapshot_metadata_parts import base_id, encode_base, encode_delta

__all__ = ["OptimizerMetadata", "SegmentStore", "all_param_groups"]

log = logging.getLogger(__name__)


class SegmentStore:
    """The moments, per-parameter and group steps in ``segment``; call order: the ``MomentStore``'s."""

    def __init__(self, segment: RemoteSegment, backend: DeviceBackend):
        self.segment = segment
        self._backend = backend
        self._optimizers: Sequence[Optimizer] = ()
        self._tensor_names: dict[torch.Tensor, list[str]] = {}
        self._fresh_group_steps: tuple[Any, ...] = ()  # what a dropped state's groups get
        self.metadata: OptimizerMetadata | None = None
        """What a snapshot says of the optimizers (once allocated)."""
        self.restored_reference: str | None = None
        """The snapshot reference the state was restored from, until the next step."""

    # -- the MomentStore calls -----------------------------------------------------------
    def allocate(self, entries: Sequence[HostCacheEntry], optimizers: Sequence[Optimizer]
                 ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """One Allocate RPC for every moment, the per-param steps and the group steps."""
        self._optimizers = optimizers
        groups = all_param_groups(optimizers)
        specs = [(PARAM_STEPS, "float32", [len(entries)]), (GROUP_STEPS, "float32", [len(groups)])]
        specs += [(state_key(e.fqn, k), dtype_name(e.dtype), list(e.shape)) for e in entries for k in e.keys]
        views = self.segment.allocate(specs, self._backend, [entry.param for entry in entries])
        self._log_sizing(entries)
        cache: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for index, entry in enumerate(entries):
            names = [state_key(entry.fqn, key) for key in entry.keys]
            cache[entry.param] = {key: views[n] for key, n in zip(entry.keys, names)}
            cache[entry.param][STEP_KEY] = views[PARAM_STEPS][index]
            self._tensor_names[entry.param] = names
        self.metadata = OptimizerMetadata(entries, optimizers, self.segment.model_area)
        self._fresh_group_steps = tuple(_clone(g.get(STEP_KEY)) for g in groups)
        if self.segment.resumed_step is not None:
            self.load_group_steps()  # a reattach's come from the segment
        return cache

    def before_step(self) -> None:
        self.verify_kept_state()  # first step after a reattach: is the kept state ours?
        if self.segment.model_area is not None:
            self.segment.model_area.wait_copy()  # the copy of the last step has read the parameters

    def before_write(self, params: Sequence[torch.Tensor]) -> None:
        self.segment.check_not_torn()
        # The step tensors change with every slice; the names are lazy: walked only while a snapshot persists.
        names_of = self._tensor_names
        names = itertools.chain((PARAM_STEPS, GROUP_STEPS), (n for p in params for n in names_of.get(p, ())))
        self.segment.mapping.before_write(self.current_step(), names)

    def after_step(self) -> None:
        self.restored_reference = None
        self.publish_step()  # the model is copied only for a snapshot

    def after_load(self) -> None:
        self.segment.mapping.before_write(self.current_step(), [GROUP_STEPS])
        self.segment.state_replaced()
        if self.segment.model_area is not None:
            # The model is loaded after the optimizer, if at all: the next snapshot copies it first.
            self.segment.model_area.copied_step = None
        self.publish_step(params_known=False)  # the model may be loaded after the optimizer

    # -- steps ---------------------------------------------------------------------------
    def current_step(self) -> int:
        steps = [g[STEP_KEY] for g in all_param_groups(self._optimizers) if STEP_KEY in g]
        return int(max((float(s) for s in steps), default=0))

    def publish_step(self, params_known: bool = True) -> int:
        """The group steps into the segment, then the segment's commit of the current step."""
        steps = [float(group.get(STEP_KEY, 0)) for group in all_param_groups(self._optimizers)]
        self.segment.views[GROUP_STEPS].copy_(torch.tensor(steps))
        return self.segment.publish(self.current_step(), params_known)

    def verify_kept_state(self) -> None:
        """First step after a reattach: a dropped state's group steps become a fresh container's."""
        if self.segment.verify_kept_state():
            return
        for group, step in zip(all_param_groups(self._optimizers), self._fresh_group_steps):
            if step is None:
                group.pop(STEP_KEY, None)
            else:
                group[STEP_KEY] = _clone(step)

    def load_group_steps(self) -> None:
        for group, step in zip(all_param_groups(self._optimizers), self.segment.views[GROUP_STEPS]):
            group[STEP_KEY] = step.clone()

    def apply_restored_metadata(self, metadata_json: str) -> None:
        """A restore's metadata into the live groups and the segment's step tensors."""
        views, tensors = self.segment.views, self.segment.mapping.tensors
        self.metadata.apply_restored(metadata_json, tensors, views[PARAM_STEPS], views[GROUP_STEPS])
        self.load_group_steps()

    def _log_sizing(self, entries: Sequence[HostCacheEntry]) -> None:
        """What this rank's segment holds and a host of the job's ranks needs (``swap-state plan``)."""
        tensors, session = self.segment.mapping.tensors, self.segment.session
        model = sum(t.nbytes for t in tensors if is_model_tensor(t.name))
        moments = sum(t.nbytes for t in tensors if t.name.startswith(STATE_PREFIX))
        params = sum(math.prod(entry.shape) for entry in entries)
        plan = plan_for_rank(params, moments, model, session.local_world_size, snapshots=bool(model))
        log.info("swap-state segment of job %s rank %d: %s; %s", self.segment.config.job_id, session.rank,
                 plan.lines()[0].removeprefix("per rank:").strip(), plan.lines()[2].removeprefix("server:").strip())


class OptimizerMetadata:
    """What a snapshot's metadata says of the optimizers (what the server cannot know), read when asked:
    sent as a base built once plus a per-snapshot delta; a restore sends the layout whole."""

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


def _clone(value: Any) -> Any:
    return value.clone() if hasattr(value, "clone") else value
