"""Load templates that match the checkpoint being loaded, for DCP's strict loading.

``dcp.load`` loads *into* a template (the container's ``state_dict()``) and, strictly, fails
on every template key the checkpoint lacks. The swap containers' own format (the seed's) has
keys torch's flattened optimizer state dict does not, so a plain torch/torchtitan AdamW
checkpoint, loaded into the full template, fails with ``Missing key in checkpoint
state_dict: optimizer.param_groups.<fqn>.step``. The design:

- The loader tells the container which keys the checkpoint holds, read from its DCP metadata
  (``FileSystemReader(path).read_metadata().state_dict_metadata``, no tensor read), for the
  duration of the load: :meth:`LoadTemplate.loading` (the container's ``loading_checkpoint``). The torchtitan
  glue does so around ``CheckpointManager.dcp_load``; a plain ``dcp.load`` caller uses
  :func:`load_template`.
- While it knows them, ``state_dict()`` is the template of *that* checkpoint
  (:func:`match_template`): its own full dict less the keys torch's format lacks and the
  checkpoint does not hold, each derived on load as the seed's load already does:
  ``param_groups.<fqn>.step`` (the group step is the largest per-parameter step) and every
  ``state.<fqn>.*`` of a parameter that has param-group entries but no state (torch creates
  state on a parameter's first update: never stepped, it loads as zeros and step 0). Nothing
  else is dropped: a checkpoint that lacks a moment of a stepped parameter still fails, naming
  the key, and every key the checkpoint holds for a parameter of the template is loaded.
- A remote container's template follows the checkpoint, not its ``checkpoint`` mode: a
  snapshot reference (:data:`SNAPSHOT_REF_KEY`) loads
  through the server (no new snapshot is taken for the template), anything else through the
  full-state path (a plain checkpoint in snapshot mode takes its moments from the checkpoint).

Without such a hint ``state_dict()`` is what it always was (a save, or an unaware caller).

A checkpoint saved in snapshot mode holds a reference instead of the moments: torch's own
optimizer cannot load it, and :func:`check_plain_optimizer_can_load` says so (naming
``swap-state export``) instead of DCP's ``Missing key ... exp_avg``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from swap_state.client.optim.host_cache import STEP_KEY
from swap_state.common.names import PARAM_GROUPS_PREFIX, STATE_PREFIX

__all__ = [
    "MODEL_REF_KEY",
    "OPTIMIZER_KEY",
    "SNAPSHOT_CHECKPOINT_ERROR",
    "SNAPSHOT_JOB_KEY",
    "SNAPSHOT_REF_KEY",
    "LoadTemplate",
    "SnapshotCheckpointError",
    "check_plain_optimizer_can_load",
    "checkpoint_keys",
    "holds_snapshot_reference",
    "load_template",
    "match_template",
    "optimizer_keys",
]

#: The key torchtitan's CheckpointManager stores the optimizer under (``OPTIMIZER``).
OPTIMIZER_KEY = "optimizer"
#: Keys of a snapshot-mode state dict (beside the seed's ``param_groups.*`` / ``state.*.step``);
#: :mod:`swap_state.client.remote.checkpoint` writes them.
SNAPSHOT_REF_KEY = "swap_state.snapshot_id"
SNAPSHOT_JOB_KEY = "swap_state.job_id"
#: The model's entry of a whole-state snapshot-mode checkpoint (a top-level key: torchtitan
#: flattens the model's state dict into the checkpoint): the same snapshot as the optimizer's.
MODEL_REF_KEY = "swap_state.model_snapshot_id"

SNAPSHOT_CHECKPOINT_ERROR = (
    "checkpoint {path} was saved with swap_state_checkpoint = 'snapshot': its optimizer entry is "
    "a reference to swap-state snapshot {snapshot} (key {key!r}), not the Adam moments, so this "
    "optimizer (torch's own: swap_optimizer is off) cannot load it. Either load it with "
    "swap_optimizer = true and swap_optimizer_backend = 'remote' (the server that holds the "
    "snapshot, or one with its --snapshot-dir), or turn the checkpoint into a plain torchtitan "
    "checkpoint with `swap-state export --format torchtitan {path} OUT_DIR --snapshot-dir "
    "<snapshot-dir>` (the snapshot alone: `swap-state export <snapshot-dir>/<job>/step-<N> OUT "
    "--format dcp`), or leave the optimizer out (checkpoint.exclude_from_loading = "
    "['optimizer'], when the checkpoint holds the model's tensors)."
)


class SnapshotCheckpointError(ValueError):
    """A snapshot-mode checkpoint was loaded into an optimizer that is not a swap container."""


def checkpoint_keys(checkpoint_id: str | os.PathLike[str]) -> frozenset[str]:
    """Every key a DCP checkpoint directory holds (its metadata only; no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    return frozenset(FileSystemReader(os.fspath(checkpoint_id)).read_metadata().state_dict_metadata)


def optimizer_keys(keys: Collection[str], key: str = OPTIMIZER_KEY) -> frozenset[str]:
    """The keys under ``<key>.`` (torchtitan's ``optimizer.``), without that prefix."""
    prefix = key + "."
    return frozenset(k[len(prefix) :] for k in keys if k.startswith(prefix))


def match_template(flat: Mapping[str, Any], held: Collection[str]) -> dict[str, Any]:
    """``flat`` (a container's full flat dict) as a load template of a checkpoint holding the
    optimizer keys ``held``: less ``param_groups.<fqn>.step`` where absent, and less every
    ``state.<fqn>.*`` of a parameter with param-group entries and no state there. Every other
    key stays, present in the checkpoint or not (DCP then names what is missing)."""
    held = frozenset(held)
    stateful: set[str] = set()
    grouped: set[str] = set()
    for key in held:
        if key.startswith(STATE_PREFIX):
            stateful.add(key[len(STATE_PREFIX) :].rpartition(".")[0])
        elif key.startswith(PARAM_GROUPS_PREFIX):
            grouped.add(key[len(PARAM_GROUPS_PREFIX) :].rpartition(".")[0])
    template: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in held:
            if key.startswith(PARAM_GROUPS_PREFIX) and key.endswith("." + STEP_KEY):
                continue  # torch has no group step: the load derives it from the parameters'
            if key.startswith(STATE_PREFIX):
                fqn = key[len(STATE_PREFIX) :].rpartition(".")[0]
                if fqn not in stateful and fqn in grouped:
                    continue  # never stepped in the checkpoint: zeros and step 0
        template[key] = value
    return template


def holds_snapshot_reference(held: Collection[str]) -> bool:
    """Whether optimizer keys ``held`` are a snapshot-mode entry (a reference, no moments)."""
    return SNAPSHOT_REF_KEY in held


def check_plain_optimizer_can_load(
    keys: Collection[str], checkpoint_id: str | os.PathLike[str], key: str = OPTIMIZER_KEY
) -> None:
    """SnapshotCheckpointError when the checkpoint's optimizer entry is a snapshot reference
    (then torch's own optimizer cannot load it); nothing otherwise."""
    held = optimizer_keys(keys, key)
    if holds_snapshot_reference(held):
        raise SnapshotCheckpointError(
            SNAPSHOT_CHECKPOINT_ERROR.format(
                path=os.fspath(checkpoint_id),
                snapshot=_read_reference(checkpoint_id, f"{key}.{SNAPSHOT_REF_KEY}") or "(unreadable)",
                key=f"{key}.{SNAPSHOT_REF_KEY}",
            )
        )


def _read_reference(checkpoint_id: str | os.PathLike[str], flat_key: str) -> str | None:
    """The snapshot id a checkpoint refers to (this process only; None if unreadable)."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        holder: dict[str, Any] = {flat_key: ""}
        dcp.load(
            holder,
            checkpoint_id=os.fspath(checkpoint_id),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
        value = holder[flat_key]
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # noqa: BLE001 - only the wording of an error depends on it
        return None


class LoadTemplate:
    """While a checkpoint load announced its keys, a container's ``state_dict()`` is that
    checkpoint's template (:func:`match_template`; a remote container picks the reference or
    full form). Held by the container; ``loading(keys)`` is its ``loading_checkpoint``."""

    def __init__(self) -> None:
        self.keys: frozenset[str] | None = None
        """The optimizer keys of the checkpoint being loaded (prefix stripped), else None."""

    @contextlib.contextmanager
    def loading(self, keys: Collection[str]) -> Iterator[None]:
        """Make ``state_dict()`` the load template of a checkpoint whose optimizer entry holds
        ``keys`` (without ``optimizer.``) until the block ends."""
        previous = self.keys
        self.keys = frozenset(keys)
        try:
            yield
        finally:
            self.keys = previous

    def apply(self, flat: dict[str, Any]) -> dict[str, Any]:
        """``flat`` matched to the checkpoint being loaded, or as it is outside a load."""
        if self.keys is None:
            return flat
        return match_template(flat, self.keys)


@contextlib.contextmanager
def load_template(
    optimizer: Any, checkpoint_id: str | os.PathLike[str], key: str = OPTIMIZER_KEY
) -> Iterator[None]:
    """For callers of ``dcp.load`` outside torchtitan's CheckpointManager::

        with load_template(container, path):
            dcp.load({"optimizer": container, ...}, checkpoint_id=path)

    ``key``: the optimizer's key in the loaded dict. A swap container's ``state_dict()``
    matches the checkpoint in the block; for any other optimizer a snapshot-mode checkpoint
    raises :class:`SnapshotCheckpointError` first."""
    keys = checkpoint_keys(checkpoint_id)
    if not hasattr(optimizer, "loading_checkpoint"):
        check_plain_optimizer_can_load(keys, checkpoint_id, key)
        yield
        return
    with optimizer.loading_checkpoint(optimizer_keys(keys, key)):
        yield
