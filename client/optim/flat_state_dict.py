"""The seed's flat optimizer state dict: ``state.<fqn>.<key>``, ``param_groups.<fqn>.<hp>``.

A parameter is named by its canonical FQN, so tied parameters are saved once and load from
any alias (:func:`~.host_cache.fqns_by_param`). :func:`flat_state_dict` writes the dict, :class:`FlatIndex` reads one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.optim.dtensor_utils import DTensor, unwrap_dtensor, wrap_like_param_without_device_move
from swap_state.client.optim.host_cache import (
    MOMENT_KEYS, STEP_KEY, HostCache, fqns_by_param, has_data, param_fqns, step_tensor)
from swap_state.common.names import PARAM_GROUPS_PREFIX, STATE_PREFIX, param_group_key, state_key

__all__ = ["FlatIndex", "clone_value", "flat_state_dict", "state_step", "state_value", "tensor_for_state_dict"]


def clone_value(value: Any) -> Any:
    """A checkpoint value detached from its source: tensors cloned to CPU, others deep-copied."""
    if isinstance(value, torch.Tensor):
        return unwrap_dtensor(value).detach().cpu().clone()
    return copy.deepcopy(value)


class FlatIndex:
    """A flat state dict's ``state.*`` and ``param_groups.*`` entries, by section and fqn."""

    SECTIONS = (STATE_PREFIX, PARAM_GROUPS_PREFIX)
    _KEY_OF = {STATE_PREFIX: state_key, PARAM_GROUPS_PREFIX: param_group_key}

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self.sections: dict[str, dict[str, dict[str, Any]]] = {prefix: {} for prefix in self.SECTIONS}
        for flat_key, value in state_dict.items():
            for prefix in self.SECTIONS:
                if flat_key.startswith(prefix):
                    fqn, _, key = flat_key[len(prefix) :].rpartition(".")
                    if fqn and key:
                        self.sections[prefix].setdefault(fqn, {})[key] = value

    def lookup(self, section: str, aliases: Sequence[str], key: str) -> tuple[str, Any] | None:
        """``(flat key, value)`` under the first alias that has ``key`` in ``section``, else None."""
        by_fqn = self.sections[section]
        hits = ((self._KEY_OF[section](fqn, key), by_fqn[fqn][key]) for fqn in aliases if key in by_fqn.get(fqn, {}))
        return next(hits, None)

    def entries(self, section: str, aliases: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
        """``(alias, {key: value})`` of the first alias with entries in ``section``."""
        by_fqn = self.sections[section]
        return next(((fqn, by_fqn[fqn]) for fqn in aliases if by_fqn.get(fqn)), None)


def flat_state_dict(model_parts: Sequence[nn.Module], optimizers: Sequence[Optimizer],
                    cpu_states: Mapping[torch.Tensor, HostCache]) -> dict[str, Any]:
    """The flat dict from the host cache: moments are views (DTensor-wrapped like their
    parameter, never copied to a device), steps and group values copies."""
    flat: dict[str, Any] = {}
    for model, optim in zip(model_parts, optimizers, strict=True):
        fqns = fqns_by_param(model)
        for group in optim.param_groups:
            for param in group["params"]:
                fqn = param_fqns(fqns, param)[0]
                state = optim.state.get(param, {})
                for key in MOMENT_KEYS:
                    value = state_value(cpu_states, param, state, key)
                    if value is not None:
                        flat[state_key(fqn, key)] = value
                flat[state_key(fqn, STEP_KEY)] = state_step(cpu_states, group, param)
                for key, value in group.items():
                    if key != "params":
                        flat[param_group_key(fqn, key)] = clone_value(value)
    return flat


def state_value(cpu_states: Mapping[torch.Tensor, HostCache], param: Any, state: Mapping[str, Any], key: str) -> Any:
    """``key``'s checkpoint value for ``param``: its host cache, else its device state."""
    value = (cpu_states.get(param) or {}).get(key)
    if value is None:
        value = state.get(key)
    return None if value is None else tensor_for_state_dict(value, param)


def state_step(cpu_states: Mapping[torch.Tensor, HostCache], group: Mapping[str, Any], param: Any) -> torch.Tensor:
    """The per-param step when known, else the group's step, as a new CPU tensor."""
    step = (cpu_states.get(param) or {}).get(STEP_KEY)
    if step is None:
        step = group.get(STEP_KEY, 0)
    return clone_value(step) if isinstance(step, torch.Tensor) else step_tensor(step)


def tensor_for_state_dict(tensor: Any, like_param: Any = None) -> Any:
    """A CPU view of ``tensor`` for a checkpoint, DTensor-wrapped like ``like_param``."""
    local = unwrap_dtensor(tensor)
    if not has_data(local):
        raise RuntimeError("cannot checkpoint a swapped-out optimizer state without CPU cache: "
                           f"tensor of shape {tuple(local.shape)} has no storage")
    value = local.detach().cpu()  # no copy where it is on the CPU
    if isinstance(like_param, DTensor):
        return wrap_like_param_without_device_move(value, like_param)
    return value
