"""Parameter names in checkpoints: the canonical FQN (DCP's, first registered alias first),
so tied parameters are saved once and load from any alias."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

# DCP's canonical FQNs (strips activation-checkpoint / compile / DDP prefixes)
from torch.distributed.checkpoint.state_dict import _get_fqns

__all__ = ["fqns_by_param", "param_fqns"]


def fqns_by_param(model: nn.Module) -> dict[torch.Tensor, tuple[str, ...]]:
    """Every parameter's checkpoint names, canonical (first registered) first."""
    names: dict[torch.Tensor, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).extend(_canonical_fqns(model, name))
    return {param: tuple(dict.fromkeys(fqns)) for param, fqns in names.items()}


def param_fqns(
    fqns: Mapping[torch.Tensor, tuple[str, ...]], param: torch.Tensor, optimizer_index: int | None = None
) -> tuple[str, ...]:
    """``param``'s names from :func:`fqns_by_param`; a clear error for a stranger."""
    names = fqns.get(param)
    if not names:
        where = "" if optimizer_index is None else f" of optimizer {optimizer_index}"
        raise ValueError(
            f"a parameter{where} (shape {tuple(param.shape)}) is not in its model part; "
            "swap optimizer state is keyed by parameter FQN"
        )
    return names


def _canonical_fqns(model: nn.Module, name: str) -> list[str]:
    fqns = _get_fqns(model, name)
    if len(fqns) != 1:
        raise NotImplementedError(
            f"parameter {name!r} maps to several FQNs {sorted(fqns)} (a flattened FSDP1 parameter); "
            "the swap optimizer needs one parameter per FQN"
        )
    return list(fqns)
