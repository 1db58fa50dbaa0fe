"""The optimizers of parameters swap-state does not swap, held by the swap container.

torchtitan 0.3 lets param groups use other optimizers than Adam and AdamW (``DistMuon``).
Their state stays where their own code keeps it; the container steps them after its own,
iterates them for LR schedulers and checkpoints them in its flat FQN-keyed dict. Nothing of
theirs is in snapshots, so whole-state snapshot checkpoints refuse them (the adapter checks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.optim import Optimizer

__all__ = ["UnswappedOptimizers"]


class UnswappedOptimizers:
    """``optimizers`` with their own step and state; ``flat_state_dict(optimizer)`` and
    ``load_flat_state_dict(optimizer, flat)`` convert their state to and from the flat dict
    (torchtitan's ``get_flat_optim_state_dict`` / ``load_flat_optim_state_dict``)."""

    def __init__(
        self, optimizers: Sequence[Optimizer], flat_state_dict: Callable[[Optimizer], dict[str, Any]],
        load_flat_state_dict: Callable[[Optimizer, Mapping[str, Any]], None],
    ) -> None:
        self.optimizers = list(optimizers)
        self._flat_state_dict = flat_state_dict
        self._load_flat_state_dict = load_flat_state_dict

    @property
    def params(self) -> list[Any]:
        return [param for optimizer in self.optimizers for group in optimizer.param_groups for param in group["params"]]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for optimizer in self.optimizers:
            flat.update(self._flat_state_dict(optimizer))
        return flat

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for optimizer in self.optimizers:
            self._load_flat_state_dict(optimizer, state_dict)
