"""What swap-state adds to torchtitan's ``CheckpointManager``, for both torchtitan lines.

0.2's adapter wraps the manager's methods, 0.3's subclasses it; both call, transparent for
torch's own optimizers:

1. :func:`attach` at the end of ``__init__``: retention, and the model's entry as a reference;
2. saves run inside :func:`~swap_state.client.torchtitan.model.saving_checkpoint`;
3. :func:`load_matched` around ``dcp_load``: the templates follow the checkpoint;
4. :func:`finish_before_close` in ``close`` (an embedded server stops with the trainer);
   :func:`skip_close_wait` from ``__del__``, where garbage collection is no place for RPCs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from swap_state.client.torchtitan.settings import snapshots_to_keep

__all__ = ["MODEL_KEY", "OPTIMIZER_KEY", "attach", "finish_before_close", "load_matched", "skip_close_wait"]

OPTIMIZER_KEY = "optimizer"  # torchtitan's checkpoint OPTIMIZER
MODEL_KEY = "model"  # torchtitan's checkpoint MODEL
_CLOSED_ATTR = "_swap_state_closed"


def attach(manager: Any, config: Any, optimizers: Any, model_parts: Any) -> None:
    """Retention and the model's entry, once the manager's ``__init__`` has run."""
    follow = getattr(optimizers, "follow_checkpoint_retention", None)
    if follow is not None and getattr(config, "enable", False) and not getattr(config, "load_only", False):
        follow(snapshots_to_keep(int(getattr(config, "keep_latest_k", 0))))
    if getattr(optimizers, "whole_state_checkpoints", False) and isinstance(manager.__dict__.get("states"), dict):
        from swap_state.client.torchtitan.model import SnapshotModelWrapper

        manager.states[MODEL_KEY] = SnapshotModelWrapper(model_parts, optimizers)


def load_matched(
    manager: Any, load: Callable[[], Any], state_dict: Any, checkpoint_id: Any, from_hf: bool
) -> Any:
    """Run ``load()`` (the manager's ``dcp_load``) with the templates matched to the checkpoint;
    a snapshot-mode checkpoint loaded into torch's own optimizer fails naming ``swap-state export``."""
    from swap_state.client.optim import checkpoint_template as template
    from swap_state.client.torchtitan.model import MODEL_REF_KEY, match_model_template

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


def finish_before_close(manager: Any) -> None:
    """Wait (once) until the snapshot the job's last checkpoint refers to is durable."""
    states = manager.__dict__.get("states")
    optimizer = states.get(OPTIMIZER_KEY) if isinstance(states, dict) else None
    finish = getattr(optimizer, "wait_checkpoint_durable", None)
    if finish is not None and getattr(manager, "enable", False) and not manager.__dict__.get(_CLOSED_ATTR):
        setattr(manager, _CLOSED_ATTR, True)
        finish()


def skip_close_wait(manager: Any) -> None:
    """From ``__del__``: the close that follows does not wait (only an explicit close waits)."""
    manager.__dict__[_CLOSED_ATTR] = True
