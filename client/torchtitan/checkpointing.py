"""What swap-state adds to torchtitan's ``CheckpointManager``, for both torchtitan lines (0.2's
adapter wraps its methods, 0.3's subclasses it): :func:`attach` at the end of ``__init__``, and
hooks ``hook(run, manager, ...)`` around the manager's own methods ``run``, transparent for
torch's own optimizers. In a whole-state snapshot-mode checkpoint the model's entry is one key,
:data:`MODEL_REF_KEY`, naming the optimizer's snapshot (:class:`SnapshotModelWrapper`).

With ``swap_state_replica_interval`` (the container's ``RemoteConfig.replica_interval``) a step of
that interval which torchtitan would not save is saved anyway, its snapshot memory-only, and its
folder marked (:data:`MEMORY_ONLY_MARKER`, holding the snapshot's id): torchtitan resumes from
its own folder, so a memory-only snapshot needs one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import ModelWrapper

from swap_state.client.optim import checkpoint_template as template
from swap_state.client.optim.checkpoint_template import MODEL_REF_KEY, OPTIMIZER_KEY, SnapshotCheckpointError
from swap_state.client.torchtitan.settings import snapshots_to_keep

__all__ = [
    "MEMORY_ONLY_MARKER", "MODEL_KEY", "MODEL_REF_KEY", "OPTIMIZER_KEY", "ModelReferenceError", "SnapshotModelWrapper",
    "attach", "close", "dcp_load", "delete", "find_load_step", "match_model_template", "purge_stale_checkpoints",
    "save", "save_last_step", "saving_checkpoint", "should_save"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"  # torchtitan's checkpoint MODEL
MEMORY_ONLY_MARKER = "swap-state-memory-only"
_CLOSED_ATTR = "_swap_state_closed"


def attach(manager: Any, config: Any, optimizers: Any, model_parts: Any) -> None:
    """Retention and the model's entry, once the manager's ``__init__`` has run."""
    follow = getattr(optimizers, "follow_checkpoint_retention", None)
    if follow is not None and getattr(config, "enable", False) and not getattr(config, "load_only", False):
        follow(snapshots_to_keep(int(getattr(config, "keep_latest_k", 0))))
    if getattr(optimizers, "whole_state_checkpoints", False) and isinstance(manager.__dict__.get("states"), dict):
        manager.states[MODEL_KEY] = SnapshotModelWrapper(model_parts, optimizers)


def save(run: Callable[..., Any], manager: Any, curr_step: int, last_step: bool = False) -> Any:
    """A save: the model's entry is the snapshot reference. At a step of the replica interval that
    torchtitan would not save, a save anyway whose snapshot is memory-only (taken first: the
    save's reference calls reuse it); rank 0 marks its folder before the save."""
    interval = _replica_interval(manager)
    saves = not interval or manager._should_save(curr_step, last_step)
    replica = not saves and curr_step % interval == 0 and manager.enable and not manager.load_only
    token = _replica_save.set(replica)
    try:
        with saving_checkpoint():
            if replica or (interval and saves):  # a persisted save unmarks an earlier attempt's folder
                _mark(manager, curr_step, _container(manager).checkpoint_reference(memory_only=True) if replica else "")
            return run(curr_step, last_step)
    finally:
        _replica_save.reset(token)


def should_save(run: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> bool:
    """torchtitan's answer, or True during a replica step's save (:func:`save`)."""
    return _replica_save.get() or run(*args, **kwargs)


def purge_stale_checkpoints(run: Callable[[], Any], manager: Any) -> Any:
    """Before torchtitan counts its ``keep_latest_k``: rank 0 removes the memory-only folders
    older than the newest (their snapshots are gone: a server keeps a job's newest memory-only
    one), so they never push the newest persisted checkpoint out."""
    if _replica_interval(manager) and _rank() == 0:
        for step in _steps(manager.folder)[:-1]:
            if os.path.isfile(_marker(manager, step)):
                shutil.rmtree(manager._create_checkpoint_id(step), ignore_errors=True)
    return run()


def find_load_step(run: Callable[..., int], manager: Any, folder: str = "") -> int:
    """torchtitan's newest step, passing over memory-only folders whose snapshot is complete on none of the places this
    host's server reads (both hosts lost, a server restarted without it): rank 0 asks, every rank loads its answer."""
    step = run(folder)
    if folder or step <= 0 or not _replica_interval(manager) or not os.path.isfile(_marker(manager, step)):
        return step
    chosen = [-1]
    if _rank() == 0:
        container = _container(manager)
        listed = {info.snapshot_id for info in container.client.list_snapshots(container.remote_config.job_id).snapshots
                  if info.stored or info.local_world_size == info.world_size}
        for older in reversed([s for s in _steps(manager.folder) if s <= step]):
            path, marker = manager._create_checkpoint_id(older), _marker(manager, older)
            snapshot_id = Path(marker).read_text() if os.path.isfile(marker) else None
            if snapshot_id is not None and snapshot_id not in listed:
                log.warning("checkpoint %s is passed over: its memory-only snapshot %s is on none of the hosts this "
                            "server reads (its memory, the replicas it holds, its peers')", path, snapshot_id)
            elif os.path.isfile(os.path.join(path, ".metadata")):
                chosen[0] = older
                break
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


_replica_save: contextvars.ContextVar[bool] = contextvars.ContextVar("swap_state_replica_save", default=False)


def _container(manager: Any) -> Any:
    states = manager.__dict__.get("states")
    return states.get(OPTIMIZER_KEY) if isinstance(states, dict) else None


def _replica_interval(manager: Any) -> int:
    return getattr(getattr(_container(manager), "remote_config", None), "replica_interval", 0)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _steps(folder: str) -> list[int]:
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(m.group(1)) for name in names if (m := re.fullmatch(r"step-(\d+)", name)))


def _marker(manager: Any, step: int) -> str:
    return os.path.join(manager._create_checkpoint_id(step), MEMORY_ONLY_MARKER)


def _mark(manager: Any, step: int, snapshot_id: str) -> None:
    """On rank 0, mark the step's folder as holding memory-only ``snapshot_id`` ("": unmark)."""
    marker = _marker(manager, step)
    if _rank() == 0 and snapshot_id:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        Path(marker).write_text(snapshot_id)
    elif _rank() == 0 and os.path.isfile(marker):
        os.remove(marker)


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
    finish = getattr(_container(manager), "wait_checkpoint_durable", None)
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
    export = f"`swap-state export --format torchtitan {path} OUT_DIR --snapshot-dir <the server's --snapshot-dir>`"
    if not isinstance(wrapper, SnapshotModelWrapper):
        raise ModelReferenceError(f"checkpoint {path} holds its model in a swap-state whole-state snapshot (key "
                                  f"{MODEL_REF_KEY!r}), not as tensors: load it with optimizer.swap_optimizer = true, "
                                  "swap_optimizer_backend = 'remote' and swap_state_checkpoint = 'snapshot', or turn "
                                  f"it into a plain torchtitan checkpoint with {export}")
    if OPTIMIZER_KEY not in state_dict:
        raise ModelReferenceError(f"checkpoint {path} holds model and optimizer in one swap-state snapshot: the model "
                                  "cannot be loaded without the optimizer (checkpoint.exclude_from_loading names "
                                  f"'optimizer', or a model-only load); export it first with {export}")
    for key in ModelWrapper.state_dict(wrapper):  # the model's tensors: not in this checkpoint
        state_dict.pop(key, None)
    state_dict[MODEL_REF_KEY] = ""
