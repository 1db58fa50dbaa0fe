"""Load templates that match the checkpoint being loaded, for DCP's strict loading.

``dcp.load`` fails on every template key the checkpoint lacks, and the seed's format has keys
torch's does not (``param_groups.<fqn>.step``). So during a load the loader tells the container
which keys the checkpoint holds (its DCP metadata), and ``state_dict()`` leaves out what the
load derives (:func:`match_template`). A snapshot-mode checkpoint, which torch's own optimizer
cannot load, fails naming ``swap-state export`` (:func:`check_plain_optimizer_can_load`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Mapping
from typing import Any

from swap_state.client.optim.flat_state_dict import FlatIndex
from swap_state.client.optim.host_cache import STEP_KEY
from swap_state.common.names import PARAM_GROUPS_PREFIX, STATE_PREFIX

__all__ = [
    "MODEL_REF_KEY", "OPTIMIZER_KEY", "SNAPSHOT_CHECKPOINT_ERROR", "SNAPSHOT_JOB_KEY", "SNAPSHOT_REF_KEY",
    "SnapshotCheckpointError", "check_plain_optimizer_can_load", "checkpoint_keys",
    "holds_snapshot_reference", "load_template", "match_template", "optimizer_keys"]

#: The key torchtitan's CheckpointManager stores the optimizer under (``OPTIMIZER``).
OPTIMIZER_KEY = "optimizer"
#: Keys of a snapshot-mode state dict (:mod:`swap_state.client.remote.container` writes them).
SNAPSHOT_REF_KEY = "swap_state.snapshot_id"
SNAPSHOT_JOB_KEY = "swap_state.job_id"
#: The model's entry of a whole-state snapshot-mode checkpoint (top-level: torchtitan flattens the model's state dict).
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
    "['optimizer'], when the checkpoint holds the model's tensors).")


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
    """``flat`` as the template of a checkpoint holding optimizer keys ``held``: less an absent
    ``param_groups.<fqn>.step`` and the ``state.<fqn>.*`` of a parameter never stepped there.
    Every other key stays (DCP then names what is missing)."""
    held = frozenset(held)
    stateful, grouped = (FlatIndex(dict.fromkeys(held)).sections[prefix] for prefix in FlatIndex.SECTIONS)
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


def check_plain_optimizer_can_load(keys: Collection[str], checkpoint_id: str | os.PathLike[str],
                                   key: str = OPTIMIZER_KEY) -> None:
    """SnapshotCheckpointError when the checkpoint's optimizer entry is a snapshot reference."""
    flat_key = f"{key}.{SNAPSHOT_REF_KEY}"
    if holds_snapshot_reference(optimizer_keys(keys, key)):
        ref = _read_reference(checkpoint_id, flat_key) or "(unreadable)"
        message = SNAPSHOT_CHECKPOINT_ERROR.format(path=os.fspath(checkpoint_id), snapshot=ref, key=flat_key)
        raise SnapshotCheckpointError(message)


def _read_reference(checkpoint_id: str | os.PathLike[str], flat_key: str) -> str | None:
    """The snapshot id a checkpoint refers to (this process only; None if unreadable)."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        holder: dict[str, Any] = {flat_key: ""}
        planner = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load(holder, checkpoint_id=os.fspath(checkpoint_id), planner=planner, no_dist=True)
        value = holder[flat_key]
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # noqa: BLE001 - only the wording of an error depends on it
        return None


def load_template(optimizer: Any, checkpoint_id: str | os.PathLike[str],
                  key: str = OPTIMIZER_KEY) -> contextlib.AbstractContextManager[None]:
    """For callers of ``dcp.load`` outside torchtitan's CheckpointManager (for any other optimizer
    a snapshot-mode checkpoint raises :class:`SnapshotCheckpointError`)::

        with load_template(container, path):
            dcp.load({"optimizer": container, ...}, checkpoint_id=path)
    """
    keys = checkpoint_keys(checkpoint_id)
    if not hasattr(optimizer, "loading_checkpoint"):
        check_plain_optimizer_can_load(keys, checkpoint_id, key)
        return contextlib.nullcontext()
    return optimizer.loading_checkpoint(optimizer_keys(keys, key))
