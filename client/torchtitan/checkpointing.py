"""What swap-state adds to torchtitan's ``CheckpointManager``, for both torchtitan lines (0.2's
adapter wraps its methods, 0.3's subclasses it): :func:`attach` at the end of ``__init__``, and
hooks ``hook(run, manager, ...)`` around the manager's own methods ``run``, transparent for
torch's own optimizers. In a whole-state snapshot-mode checkpoint the model's entry is one key,
:data:`MODEL_REF_KEY`, naming the optimizer's snapshot (:class:`SnapshotModelWrapper`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Collection, Iterator
from typing import Any

from torchtitan.components.checkpoint import ModelWrapper

from swap_state.client.optim import checkpoint_template as template
from swap_state.client.optim.checkpoint_template import MODEL_REF_KEY, OPTIMIZER_KEY, SnapshotCheckpointError
from swap_state.client.torchtitan.settings import snapshots_to_keep

__all__ = [
    "MODEL_KEY", "MODEL_REF_KEY", "OPTIMIZER_KEY", "ModelReferenceError", "SnapshotModelWrapper", "attach", "close",
    "dcp_load", "delete", "match_model_template", "save", "save_last_step", "saving_checkpoint"]

MODEL_KEY = "model"  # torchtitan's checkpoint MODEL
_CLOSED_ATTR = "_swap_state_closed"


def attach(manager: Any, config: Any, optimizers: Any, model_parts: Any) -> None:
    """Retention and the model's entry, once the manager's ``__init__`` has run."""
    follow = getattr(optimizers, "follow_checkpoint_retention", None)
    if follow is not None and getattr(config, "enable", False) and not getattr(config, "load_only", False):
        follow(snapshots_to_keep(int(getattr(config, "keep_latest_k", 0))))
    if getattr(optimizers, "whole_state_checkpoints", False) and isinstance(manager.__dict__.get("states"), dict):
        manager.states[MODEL_KEY] = SnapshotModelWrapper(model_parts, optimizers)


def save(run: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
    """A save: the model's entry is the snapshot reference."""
    with saving_checkpoint():
        return run(*args, **kwargs)


def save_last_step(run: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
    """The last step's save: a reference too, unless model-only (for export and inference)."""
    with saving_checkpoint(refer=not getattr(manager, "last_save_model_only", False)):
        return run(*args, **kwargs)


def dcp_load(run: Callable[..., Any], manager: Any, state_dict: Any, checkpoint_id: Any, *args: Any,
             **kwargs: Any) -> Any:
    """The manager's ``dcp_load`` with the templates matched to the checkpoint; a snapshot-mode
    checkpoint loaded into torch's own optimizer fails naming ``swap-state export``."""
    load = functools.partial(run, state_dict, checkpoint_id, *args, **kwargs)
    from_hf = args[0] if args else kwargs.get("from_hf", False)
    if from_hf or not isinstance(state_dict, dict) or not os.path.isdir(str(checkpoint_id)):
        return load()
    keys = template.checkpoint_keys(checkpoint_id)
    optimizer = state_dict.get(OPTIMIZER_KEY)
    loading = getattr(optimizer, "loading_checkpoint", None)
    if optimizer is not None and loading is None:
        template.check_plain_optimizer_can_load(keys, checkpoint_id)  # its error names the snapshot
    model = manager.__dict__.get("states", {}).get(MODEL_KEY)
    if MODEL_REF_KEY in keys or MODEL_REF_KEY in state_dict:
        match_model_template(state_dict, model, keys, checkpoint_id)
    if loading is None:
        return load()
    with loading(template.optimizer_keys(keys)):
        return load()


def close(run: Callable[[], Any], manager: Any) -> None:
    """Wait (once) until the snapshot the job's last checkpoint refers to is durable, then close."""
    states = manager.__dict__.get("states")
    optimizer = states.get(OPTIMIZER_KEY) if isinstance(states, dict) else None
    finish = getattr(optimizer, "wait_checkpoint_durable", None)
    if finish is not None and getattr(manager, "enable", False) and not manager.__dict__.get(_CLOSED_ATTR):
        setattr(manager, _CLOSED_ATTR, True)
        finish()
    run()


def delete(run: Callable[[], Any], manager: Any) -> None:
    """From ``__del__``: the close that follows does not wait (garbage collection is no place
    for RPCs; only an explicit close waits)."""
    manager.__dict__[_CLOSED_ATTR] = True
    run()


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


def match_model_template(state_dict: dict[str, Any], wrapper: Any, keys: Collection[str],
                         checkpoint_id: str | os.PathLike[str]) -> None:
    """Make the load template ``state_dict`` hold the model in the checkpoint's form (in place);
    ModelReferenceError where this job cannot restore the checkpoint's reference."""
    if MODEL_REF_KEY not in keys:
        if state_dict.pop(MODEL_REF_KEY, None) is not None and isinstance(wrapper, ModelWrapper):
            state_dict.update(ModelWrapper.state_dict(wrapper))
        return
    path = os.fspath(checkpoint_id)
    if not isinstance(wrapper, SnapshotModelWrapper):
        raise ModelReferenceError(f"checkpoint {path} holds its model in a swap-state whole-state snapshot (key "
                                  f"{MODEL_REF_KEY!r}), not as tensors: load it with optimizer.swap_optimizer = true, "
                                  "swap_optimizer_backend = 'remote' and swap_state_checkpoint = 'snapshot', or turn "
                                  "it into a plain torchtitan checkpoint with `swap-state export --format torchtitan "
                                  f"{path} OUT_DIR --snapshot-dir <the server's --snapshot-dir>`")
    if OPTIMIZER_KEY not in state_dict:
        raise ModelReferenceError(f"checkpoint {path} holds model and optimizer in one swap-state snapshot: the model "
                                  "cannot be loaded without the optimizer (checkpoint.exclude_from_loading names "
                                  "'optimizer', or a model-only load); export it first with `swap-state export "
                                  f"--format torchtitan {path} OUT_DIR --snapshot-dir <the server's --snapshot-dir>`")
    for key in ModelWrapper.state_dict(wrapper):  # the model's tensors: not in this checkpoint
        state_dict.pop(key, None)
    state_dict[MODEL_REF_KEY] = ""
