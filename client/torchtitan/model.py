"""torchtitan's model entry in a whole-state snapshot-mode checkpoint: a reference, not tensors.

With ``swap_state_checkpoint = "snapshot"`` the snapshots hold the model's parameters too, so the
model's part of the checkpoint is one key, :data:`MODEL_REF_KEY`, naming the optimizer's snapshot.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Collection, Iterator
from typing import Any

from torchtitan.components.checkpoint import ModelWrapper

from swap_state.client.optim.checkpoint_template import MODEL_REF_KEY, OPTIMIZER_KEY, SnapshotCheckpointError

__all__ = [
    "MODEL_REF_KEY", "ModelReferenceError", "SnapshotModelWrapper", "match_model_template",
    "saving_checkpoint",
]

_saving: contextvars.ContextVar[bool] = contextvars.ContextVar("swap_state_saving_checkpoint", default=False)


@contextlib.contextmanager
def saving_checkpoint(refer: bool = True) -> Iterator[None]:
    """While active, a :class:`SnapshotModelWrapper`'s ``state_dict()`` is the reference (if ``refer``)."""
    token = _saving.set(refer)
    try:
        yield
    finally:
        _saving.reset(token)


class ModelReferenceError(SnapshotCheckpointError):
    """A whole-state checkpoint's model entry cannot be loaded the way it was asked."""


class SnapshotModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper`` whose checkpointed form is a snapshot reference."""

    def __init__(self, model: Any, container: Any) -> None:
        super().__init__(model)
        self.container = container

    def state_dict(self) -> dict[str, Any]:
        if _saving.get():
            return {MODEL_REF_KEY: self.container.checkpoint_reference()}
        return super().state_dict()  # a load template (then matched to the checkpoint) or export

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        reference = state_dict.get(MODEL_REF_KEY)
        if reference is None:
            super().load_state_dict(state_dict)
            return
        if isinstance(reference, bytes):
            reference = reference.decode()
        self.container.restore_reference(str(reference))  # puts the parameters back
        # torchtitan's cache of the model's state dict (0.2's name, then 0.3's).
        for cache in ("cache_state_dict", "cached_state_dict"):
            if cache in self.__dict__:
                self.__dict__[cache] = self._get_state_dict()


def match_model_template(
    state_dict: dict[str, Any], wrapper: Any, keys: Collection[str], checkpoint_id: str | os.PathLike[str]
) -> None:
    """Make the load template ``state_dict`` hold the model in the checkpoint's form (in place);
    ModelReferenceError where this job cannot restore the checkpoint's reference."""
    if MODEL_REF_KEY not in keys:
        if state_dict.pop(MODEL_REF_KEY, None) is not None and isinstance(wrapper, ModelWrapper):
            state_dict.update(ModelWrapper.state_dict(wrapper))
        return
    path = os.fspath(checkpoint_id)
    if not isinstance(wrapper, SnapshotModelWrapper):
        raise ModelReferenceError(
            f"checkpoint {path} holds its model in a swap-state whole-state snapshot (key "
            f"{MODEL_REF_KEY!r}), not as tensors: load it with optimizer.swap_optimizer = true, "
            "swap_optimizer_backend = 'remote' and swap_state_checkpoint = 'snapshot', or turn "
            "it into a plain torchtitan checkpoint with `swap-state export --format torchtitan "
            f"{path} OUT_DIR --snapshot-dir <the server's --snapshot-dir>`"
        )
    if OPTIMIZER_KEY not in state_dict:
        raise ModelReferenceError(
            f"checkpoint {path} holds model and optimizer in one swap-state snapshot: the model "
            "cannot be loaded without the optimizer (checkpoint.exclude_from_loading names "
            "'optimizer', or a model-only load); export it first with `swap-state export "
            f"--format torchtitan {path} OUT_DIR --snapshot-dir <the server's --snapshot-dir>`"
        )
    for key in ModelWrapper.state_dict(wrapper):  # the model's tensors: not in this checkpoint
        state_dict.pop(key, None)
    state_dict[MODEL_REF_KEY] = ""
