"""torchtitan 0.3's checkpoint manager with swap-state's additions (:mod:`.checkpointing`).

It overrides only the hooks torchtitan documents for subclasses ("override the hooks, not the
public methods"), and for ``swap_state_replica_interval`` the private methods that decide a save,
purge and find the load step; with torch's own optimizers it behaves as torchtitan's manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpointer import CheckpointManager

from swap_state.client.torchtitan import checkpointing

__all__ = ["SwapStateCheckpointManager"]


class SwapStateCheckpointManager(CheckpointManager):
    """torchtitan 0.3's ``CheckpointManager`` with :mod:`.checkpointing`'s additions (retention, snapshot
    references, loads in the checkpoint's form, ``close`` waiting for durability)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        checkpointing.attach(self, config, kwargs.get("optimizers"), kwargs.get("model_parts"))

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        return checkpointing.save(super()._save, self, curr_step, last_step)

    def _save_last_step(self, curr_step: int) -> None:
        checkpointing.save_last_step(super()._save_last_step, self, curr_step)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        return checkpointing.dcp_load(super().dcp_load, self, state_dict, checkpoint_id, from_hf, from_quantized)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return checkpointing.should_save(super()._should_save, self, curr_step, last_step)

    def _purge_stale_checkpoints(self) -> None:
        checkpointing.purge_stale_checkpoints(super()._purge_stale_checkpoints, self)

    def _find_load_step(self, folder: str = "") -> int:
        return checkpointing.find_load_step(super()._find_load_step, self, folder)

    def _close(self) -> None:
        checkpointing.close(super()._close, self)

    def __del__(self) -> None:
        checkpointing.delete(super().__del__, self)
