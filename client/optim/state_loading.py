"""``load_state_dict`` of the swap optimizer: validate and plan everything (:meth:`StateLoader.load` says in which
order), then commit. Nothing live changes before ``_commit_load``, so a bad checkpoint raises naming the key and leaves
the container as it was."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.device import DeviceBackend
from swap_state.client.optim.dtensor_utils import unwrap_dtensor
from swap_state.client.optim.flat_state_dict import FlatIndex, clone_value
from swap_state.client.optim.host_cache import (
    HostCaches, MOMENT_KEYS, device_placeholders, STEP_KEY, HostCache, HostCacheEntry, as_number, group_map,
    fqns_by_param, has_data, host_cache_ready, moment_keys, param_fqns, step_tensor)
from swap_state.common.names import PARAM_GROUPS_PREFIX, STATE_PREFIX, param_group_key, state_key

__all__ = ["StateLoader"]


@dataclass(eq=False)
class _ParamLoad:
    """A validated, prepared load of one parameter (``entry``: its host cache's layout)."""

    entry: HostCacheEntry
    sources: dict[str, torch.Tensor | None]  # None: never stepped in the checkpoint -> zeros
    step: float
    host: HostCache | None
    placeholders: dict[str, Any] = field(default_factory=dict)


class StateLoader:
    """``load_state_dict()`` into the host caches of the optimizers of ``model_parts``."""

    def __init__(self, host_caches: HostCaches, backend: DeviceBackend, model_parts: Sequence[nn.Module]):
        self._host_caches = host_caches
        self._backend = backend
        self._model_parts = model_parts

    def load(self, state_dict: Mapping[str, Any]) -> None:
        """Load a flat state dict (any alias of tied parameters); the checkpoint is only read."""
        store = self._host_caches.store
        loads, groups = self._plan_load(state_dict)
        store.before_write([load.entry.param for load in loads])
        self._commit_load(loads, groups)
        self._backend.empty_cache()
        store.after_load()

    def _plan_load(self, state_dict: Mapping[str, Any]) -> tuple[list[_ParamLoad], list[tuple[dict, dict]]]:
        """Validate ``state_dict`` against every group and parameter; prepare the load."""
        index = FlatIndex(state_dict)
        plan: list[_ParamLoad] = []
        groups: list[tuple[dict, dict]] = []  # (live group, the checkpoint's values)
        parts = zip(self._model_parts, self._host_caches.optimizers, strict=True)
        for optimizer_index, (model, optim) in enumerate(parts):
            fqns = fqns_by_param(model)
            for group_index, group in enumerate(optim.param_groups):
                values = _plan_group_load(index, optim, group, fqns)
                loads = [self._plan_param_load(index, optimizer_index, group_index, group, values, param, fqns)
                         for param in group["params"]]
                if STEP_KEY not in values and STEP_KEY in group and loads:
                    values[STEP_KEY] = step_tensor(max(load.step for load in loads))
                groups.append((group, values))
                plan.extend(loads)
        missing = [load for load in plan if load.host is None]  # allocated; nothing live changes
        if missing:
            allocated = self._host_caches.store.allocate([load.entry for load in missing], self._host_caches.optimizers)
            for load in missing:
                load.host = self._host_caches.checked(load.entry, allocated.get(load.entry.param))
        for load in plan:
            load.placeholders = device_placeholders(load.entry, load.host)  # type: ignore[arg-type]
        return plan, groups

    def _plan_param_load(self, index: FlatIndex, optimizer_index: int, group_index: int, group: dict[str, Any],
                         values: dict[str, Any], param: torch.Tensor,
                         fqns: Mapping[torch.Tensor, tuple[str, ...]]) -> _ParamLoad:
        """One parameter's load: its sources (under any alias), checked against its shard."""
        aliases = param_fqns(fqns, param, optimizer_index)
        keys = moment_keys(group)
        local_param = unwrap_dtensor(param)
        dtype = self._host_caches.moment_dtype or local_param.dtype
        _check_amsgrad(index.lookup(PARAM_GROUPS_PREFIX, aliases, "amsgrad"), group)
        sources, step = _checked_sources(index, aliases, keys, values, local_param, dtype)
        host = self._host_caches.cpu_states.get(param)
        ready = host is not None and host_cache_ready(host, group, local_param, dtype)
        entry = HostCacheEntry(param, aliases[0], keys, local_param.shape, dtype, optimizer_index, group_index)
        return _ParamLoad(entry, sources, step, host if ready else None)

    def _commit_load(self, loads: list[_ParamLoad], groups: list[tuple[dict, dict]]) -> None:
        """Apply a prepared plan; on an error, dict-level state is restored (not copied bytes)."""
        saved = self._rollback_point()
        try:
            for load in loads:
                self._commit_param_load(load)
            for group, values in groups:
                group.update(values)
            for optim in self._host_caches.optimizers:
                optim.param_to_group_map = group_map(optim)  # type: ignore[attr-defined]
        except BaseException:
            saved()
            raise

    def _commit_param_load(self, load: _ParamLoad) -> None:
        """Copy one parameter's state into its host cache and install its placeholders."""
        host = load.host
        assert host is not None
        for key in load.entry.keys:
            source, target = load.sources[key], host[key]
            assert target is not None
            if source is None:
                target.zero_()
            else:
                target.copy_(source)
        if host.get(STEP_KEY) is None:
            host[STEP_KEY] = step_tensor(0)
        host[STEP_KEY].fill_(load.step)  # type: ignore[union-attr]
        for key in MOMENT_KEYS:
            host.setdefault(key, None)
        self._host_caches.set(load.entry, host, load.placeholders)

    def _rollback_point(self) -> Callable[[], None]:
        """Snapshot every dict ``_commit_load`` mutates; the returned callable restores them."""
        caches = self._host_caches
        optims = caches.optimizers
        dicts = [*(group for optim in optims for group in optim.param_groups), *(optim.state for optim in optims),
                 *(state for optim in optims for state in optim.state.values()),
                 *(host for host in caches.cpu_states.values() if host is not None),
                 caches.cpu_states, caches.device_states]
        saved = [(target, dict(target)) for target in dicts]
        group_maps = [(optim, getattr(optim, "param_to_group_map", None)) for optim in optims]

        def restore() -> None:
            for target, contents in saved:
                target.clear()
                target.update(contents)
            for optim, group_map_ in group_maps:
                optim.param_to_group_map = group_map_  # type: ignore[attr-defined]

        return restore


def _plan_group_load(index: FlatIndex, optim: Optimizer, group: dict[str, Any],
                     fqns: Mapping[torch.Tensor, tuple[str, ...]]) -> dict[str, Any]:
    """The checkpoint's hyperparameters for ``group``, from the first of its parameters found
    (a checkpoint may group differently; ``amsgrad`` is checked per parameter)."""
    found = (index.entries(PARAM_GROUPS_PREFIX, fqns.get(param, ())) for param in group["params"])
    _, entries = next(filter(None, found), (None, {}))
    values = {key: clone_value(value) for key, value in entries.items() if key != "params"}
    if isinstance(optim, torch.optim.AdamW) and "decoupled_weight_decay" in values:
        values["decoupled_weight_decay"] = True  # as AdamW.__setstate__
    return values


def _checked_sources(index: FlatIndex, aliases: Sequence[str], keys: tuple[str, ...], group_values: Mapping[str, Any],
                     local_param: torch.Tensor, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor | None], float]:
    """``({key: checkpoint tensor}, step)`` of one parameter; only param-group entries: never
    stepped (torch creates state lazily), so zeros (``None``) and step 0."""
    fqn = aliases[0]
    hits = {key: index.lookup(STATE_PREFIX, aliases, key) for key in (*keys, STEP_KEY)}
    if not any(hits.values()):
        if index.entries(PARAM_GROUPS_PREFIX, aliases) is None:
            raise KeyError(f"optimizer state dict has no entries for parameter {fqn!r}: "
                           f"no {state_key(fqn, 'exp_avg')!r} nor {param_group_key(fqn, '*')!r} "
                           f"(aliases tried: {list(aliases)})")
        return dict.fromkeys(keys), 0.0
    sources: dict[str, torch.Tensor | None] = {}
    for key in keys:
        hit = hits[key]
        if hit is None:
            raise KeyError(f"optimizer state dict has no {state_key(fqn, key)!r} (aliases tried: {list(aliases)})")
        sources[key] = _checked_state_tensor(hit[0], hit[1], local_param, dtype)
    return sources, _checked_step(hits[STEP_KEY], group_values, fqn)


def _check_amsgrad(hit: tuple[str, Any] | None, group: Mapping[str, Any]) -> None:
    """The host cache layout is fixed at construction: a checkpoint cannot switch amsgrad."""
    if hit is not None and bool(hit[1]) != bool(group.get("amsgrad", False)):
        raise ValueError(f"optimizer state dict key {hit[0]!r} is {hit[1]} but this container was built with "
                         f"amsgrad={group.get('amsgrad', False)} (the host cache layout is fixed)")


def _checked_state_tensor(flat_key: str, value: Any, local_param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value``'s local tensor if it fits a moment of ``dtype`` (bfloat16 moments convert floats)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"optimizer state dict key {flat_key!r}: expected a tensor, got {type(value).__name__}")
    local = unwrap_dtensor(value)
    if local.is_meta or not has_data(local):
        raise ValueError(f"optimizer state dict key {flat_key!r}: the tensor has no data")
    if local.shape != local_param.shape:
        raise ValueError(f"optimizer state dict key {flat_key!r}: shape {tuple(local.shape)} does not match "
                         f"the parameter's local shape {tuple(local_param.shape)}")
    converts = dtype != local_param.dtype and local.is_floating_point()
    if local.dtype != dtype and not converts:
        raise ValueError(f"optimizer state dict key {flat_key!r}: dtype {local.dtype} does not match "
                         f"the parameter's {local_param.dtype}")
    return local


def _checked_step(hit: tuple[str, Any] | None, group_values: Mapping[str, Any], fqn: str) -> float:
    """The parameter's step: its own entry, else its param group's."""
    if hit is None:
        if STEP_KEY not in group_values:
            raise KeyError(f"optimizer state dict has no {state_key(fqn, STEP_KEY)!r} and no param group step")
        hit = (param_group_key(fqn, STEP_KEY), group_values[STEP_KEY])
    flat_key, value = hit
    try:
        return as_number(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"optimizer state dict key {flat_key!r}: expected a number or one-element tensor") from exc
