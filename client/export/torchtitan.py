"""``swap-state export --format torchtitan``: a snapshot-mode torchtitan checkpoint as a plain one, offline: the
checkpoint's references (model and optimizer) resolved against the snapshot, written as a DCP checkpoint plain
torchtitan loads (the model's state dict at the top level, ``optimizer`` flat, the small states such as ``lr_scheduler``
copied as they are)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Any

from swap_state.client.export.snapshot import ExportError, ExportResult, locate, read_snapshot_state, save_dcp
from swap_state.client.optim.checkpoint_template import MODEL_REF_KEY, OPTIMIZER_KEY, SNAPSHOT_REF_KEY

__all__ = ["export_torchtitan_checkpoint", "read_checkpoint"]


def read_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything a DCP checkpoint directory holds, nested as it was saved (no template)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from swap_state.client.export.dcp_safe import SafeFileSystemReader, SafeLoadPlanner

    path = pathlib.Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise ExportError(f"{path} is not a DCP checkpoint directory (no .metadata): pass a torchtitan .../step-<N>")
    # What torch's own dcp_to_torch_save does (the public dcp.load needs a template): torch
    # has no public call that loads a whole checkpoint into a fresh dict. Nothing in it runs.
    state: dict[str, Any] = {}
    reader, planner = SafeFileSystemReader(str(path)), SafeLoadPlanner()
    try:
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except BaseException:  # DCP wraps what they raised (CheckpointException is a BaseException)
        refused = reader.refused or planner.refused
        if refused is not None:
            raise ExportError(str(refused)) from None
        raise
    return state


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _snapshot_id(checkpoint: dict[str, Any], path: pathlib.Path) -> str:
    """The snapshot both references name (they must agree)."""
    optimizer = checkpoint.get(OPTIMIZER_KEY)
    model_ref = checkpoint.get(MODEL_REF_KEY)
    optimizer_ref = optimizer.get(SNAPSHOT_REF_KEY) if isinstance(optimizer, dict) else None
    if model_ref is None:
        raise ExportError(f"{path} is not a whole-state snapshot-mode torchtitan checkpoint: it has no "
                          f"{MODEL_REF_KEY!r} (a plain or 'full' checkpoint needs no export; a snapshot of the "
                          "optimizer alone exports with --format dcp)")
    if optimizer_ref is not None and _text(optimizer_ref) != _text(model_ref):
        raise ExportError(f"{path}: the model refers to snapshot {_text(model_ref)!r}, the optimizer to "
                          f"{_text(optimizer_ref)!r}")
    if not _text(model_ref):
        raise ExportError(f"{path} was saved before the first step: its snapshot reference is empty")
    return _text(model_ref)


def _plain_checkpoint(checkpoint: dict[str, Any], model: dict[str, Any], optimizer: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in checkpoint.items() if k != OPTIMIZER_KEY and not k.startswith("swap_state.")}
    clash = sorted(set(out) & set(model))
    if clash:
        raise ExportError(f"model keys collide with the checkpoint's other states: {clash[:5]}")
    out.update(model)
    out[OPTIMIZER_KEY] = optimizer
    return out


def export_torchtitan_checkpoint(checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                                 snapshot_dir: str | os.PathLike[str] | None = None, *,
                                 snapshot_store: str | None = None, store_timeout_s: float | None = None,
                                 progress: bool | None = None) -> ExportResult:
    """Write the plain torchtitan checkpoint of a whole-state snapshot-mode one to ``out_dir``, which
    must not exist yet; raises SnapshotError subclasses."""
    if snapshot_dir is None and snapshot_store is None:
        raise ExportError("--format torchtitan needs --snapshot-dir DIR (the server's local snapshot directory) "
                          "or --snapshot-store URI (its snapshot store)")
    source = pathlib.Path(checkpoint_dir)
    out = pathlib.Path(out_dir)
    if out.exists():
        raise ExportError(f"{out} exists already: remove it or name another output directory")
    checkpoint = read_checkpoint(source)
    snapshot_id = _snapshot_id(checkpoint, source)
    state = read_snapshot_state(locate(snapshot_id, snapshot_dir, snapshot_store, store_timeout_s), progress)
    if not state.model:
        raise ExportError(f"snapshot {snapshot_id} holds no model tensors (it was not taken with snapshot_model)")
    plain = _plain_checkpoint(checkpoint, state.model, state.flat)
    # DCP into a hidden sibling, renamed into place: never a half-written checkpoint there.
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        save_dcp(plain, partial)
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ExportResult(snapshot_id, out, "torchtitan", len(state.optimizer), len(plain[OPTIMIZER_KEY]), state.ranks,
                        state.info.world_size, model_tensors=len(state.model))
