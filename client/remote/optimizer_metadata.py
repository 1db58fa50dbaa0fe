"""What a snapshot's metadata says of the optimizers (fqns, moment keys, DTensor layout, param
groups, steps: what the server cannot know), sent as a base built once plus a per-snapshot
delta; a restore sends the layout whole and gets the snapshot's metadata back.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from swap_state.client.optim.dtensor_utils import global_layout
from swap_state.client.optim.host_cache import STEP_KEY, HostCacheEntry
from swap_state.client.remote.model_area import ModelArea
from swap_state.client.remote.segment_mapping import dtype_name
from swap_state.common.names import param_group_key, state_key
from swap_state.common.snapshot_metadata import (
    TENSOR_TAG, TensorMetadata, encode_metadata, parse_metadata, tagged_scalar)
from swap_state.common.snapshot_metadata_parts import base_id, encode_base, encode_delta

__all__ = ["OptimizerMetadata", "all_param_groups", "group_offsets", "json_value"]


class OptimizerMetadata:
    """The metadata of one container's segment, read when asked (groups and steps change)."""

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
