"""``swap-state export``: a snapshot as a standard checkpoint, loadable without swap-state.

Reads a complete snapshot directory (verifying every checksum first, with the server's own
reader, which is pure Python) and writes the seed's flat optimizer state dict::

    state.<fqn>.<key>           tensors (exp_avg, exp_avg_sq, ...), full (global) shape
    state.<fqn>.step            0-dim float32 tensor (as torch's Adam keeps it)
    param_groups.<fqn>.<hp>     hyperparameters (floats, tuples, bools, None, tensors)

either as one ``torch.save`` file (``torch.load(out, weights_only=True)`` reads it) or as a
``torch.distributed.checkpoint`` directory (``dcp.load`` into a template, any sharding). A
snapshot in a snapshot store (``--snapshot-store``) is downloaded and verified into a
temporary local snapshot directory first (:mod:`.from_store`) and exported from there.

DTensor shards of all ranks present are assembled into global tensors from the manifest's
global shape and offsets; every element must be covered by some shard. A snapshot of one host
of a multi-host job (one server per host) holds that host's ranks only (``snapshot.json``:
``ranks`` < ``world_size``): it exports those ranks, which is complete for replicated (DDP)
state; a sharded tensor whose other shards are on other hosts' servers is refused, naming the
ranks present, rather than exported with holes. Every shard in a snapshot is such a box:
the trainer checks each DTensor's shard when it describes it, a ``_StridedShard`` one (FSDP
over a tensor-parallel dimension) included, and refuses a layout whose shard is not one box
(:func:`~swap_state.client.optim.dtensor_utils.check_shard_is_a_box`), so no row is placed
wrongly here. A tensor the trainer gave no
fqn/key for is written as ``state.<segment tensor name>``, except the container's own
``swap_state.*`` step vectors (their values are the ``step`` entries above). The model tensors
of a whole-state snapshot (``model.<fqn>``) are not part of these formats: ``swap-state export
--format torchtitan`` (:mod:`swap_state.client.export.torchtitan`) writes them with the rest of
a torchtitan checkpoint. Everything is assembled in host memory.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open
from swap_state.client.export.errors import ExportError
from swap_state.client.remote.segment_mapping import TORCH_DTYPES
from swap_state.common.names import (
    MODEL_PREFIX,
    STATE_PREFIX,
    is_model_tensor,
    param_group_key,
    parse_snapshot_id,
    state_key,
)
from swap_state.common.segment import TensorLayout
from swap_state.common.snapshot_format import RankManifest, TensorRecord
from swap_state.common.snapshot_metadata import BOOKKEEPING_PREFIX, TENSOR_TAG, parse_metadata
from swap_state.common.snapshot_reader import SnapshotInfo, SnapshotReader

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportResult",
    "SnapshotState",
    "export_snapshot",
    "load_flat_state_dict",
    "read_snapshot_state",
]

FORMATS = ("torch", "dcp")



@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`export_snapshot` wrote."""

    snapshot_id: str
    """The exported snapshot."""
    out: pathlib.Path
    """The file (torch) or directory (dcp) written."""
    format: str
    """``torch`` or ``dcp``."""
    tensors: int
    """Number of ``state.<fqn>.<key>`` tensors."""
    entries: int
    """Number of keys in the state dict."""
    ranks: tuple[int, ...] = ()
    """The ranks exported: those the snapshot directory holds."""
    world_size: int = 0
    """The job's world size (above ``len(ranks)``: one host's snapshot of a multi-host job)."""


def _decode(value: Any) -> Any:
    """Manifest JSON -> state-dict value: tagged 0-dim tensors, lists back to tuples (JSON has
    no tuples; torch optimizers keep betas as one)."""
    if isinstance(value, dict):
        if TENSOR_TAG in value:
            return torch.tensor(value[TENSOR_TAG], dtype=TORCH_DTYPES[value.get("dtype", "float32")])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def _decode_step(value: Any) -> torch.Tensor:
    decoded = _decode(value)
    if isinstance(decoded, torch.Tensor):
        return decoded
    return torch.tensor(float(decoded), dtype=torch.float32)


#: Segment tensors of RemoteSwapOptimizersContainer's own bookkeeping (``swap_state.param_steps``,
#: ``swap_state.group_steps``): the manifest's ``steps`` and ``param_groups`` carry the same
#: values as ``state.<fqn>.step`` / ``param_groups.<fqn>.step``, so they are not exported.
def _is_bookkeeping(tensor: TensorRecord) -> bool:
    return not (tensor.fqn and tensor.key) and tensor.name.startswith(BOOKKEEPING_PREFIX)


def _state_key(tensor: TensorRecord) -> str:
    if tensor.fqn and tensor.key:
        return state_key(tensor.fqn, tensor.key)
    return STATE_PREFIX + tensor.name


class _Assembler:
    """Global tensors built from shards, with a coverage mask per sharded tensor."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.covered: dict[str, torch.Tensor] = {}
        self.sources: dict[str, str] = {}

    def add(self, key: str, record: TensorRecord, local: torch.Tensor, where: str) -> None:
        if record.global_shape is None:
            if key in self.values:
                # A plain tensor on several ranks is replicated (DDP); the lowest rank wins.
                if tuple(self.values[key].shape) != tuple(local.shape):
                    raise ExportError(
                        f"{where}: {key} has shape {list(local.shape)}, another rank's is "
                        f"{list(self.values[key].shape)} ({self.sources[key]})"
                    )
                return
            self.values[key] = local
            self.sources[key] = where
            return
        shape = record.global_shape
        if key not in self.values:
            self.values[key] = torch.zeros(shape, dtype=local.dtype)
            self.covered[key] = torch.zeros(shape, dtype=torch.bool)
            self.sources[key] = where
        target = self.values[key]
        if tuple(target.shape) != tuple(shape) or key not in self.covered:
            raise ExportError(f"{where}: {key} has global shape {list(shape)}, another rank disagrees")
        offset = record.global_offset or (0,) * len(shape)
        if any(o + s > g for o, s, g in zip(offset, local.shape, shape)):
            raise ExportError(
                f"{where}: shard {record.name!r} of shape {list(local.shape)} at offset "
                f"{list(offset)} exceeds global shape {list(shape)}"
            )
        region = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
        target[region] = local
        self.covered[key][region] = True

    def finish(self, info: SnapshotInfo | None = None) -> dict[str, torch.Tensor]:
        for key, mask in self.covered.items():
            if not bool(mask.all()):
                message = (
                    f"{key}: the shards of all ranks cover {int(mask.sum())} of "
                    f"{mask.numel()} elements of the global tensor"
                )
                if info is not None and not info.index.complete_job:
                    message = (
                        f"{key}: the shards of the {info.describe_ranks()} in {info.path} "
                        f"cover {int(mask.sum())} of {mask.numel()} elements of the global "
                        "tensor; the other ranks' shards are in the snapshots of the same step "
                        "on the other hosts' servers, so this host's snapshot alone cannot be "
                        "exported as a full state dict"
                    )
                raise ExportError(message)
        return self.values


def _resolve(snapshot: str | os.PathLike[str], snapshot_dir: str | os.PathLike[str] | None) -> tuple[SnapshotReader, SnapshotInfo]:
    """A snapshot id under ``snapshot_dir``, else a path ``<snapshot-dir>/<job>/step-<N>``
    with the step in either spelling: the directory's (``step-000000000025``) or the short
    one (``step-25``, which names the same directory), or ``<job>/latest``."""
    if snapshot_dir is not None:
        reader = SnapshotReader(snapshot_dir)
        return reader, reader.resolve(os.fspath(snapshot))
    path = pathlib.Path(os.path.abspath(snapshot))
    snapshot_id = f"{path.parent.name}/{path.name}"
    try:
        parse_snapshot_id(snapshot_id, error=ExportError)
    except ExportError:
        snapshot_id = None
    if snapshot_id is None or not (path.is_dir() or path.parent.is_dir()):
        raise ExportError(
            f"{path} is not a snapshot directory (<snapshot-dir>/<job>/step-<N>, e.g. "
            "/snapshots/demo/step-25 or /snapshots/demo/step-000000000025); an id such as "
            "demo/step-25 needs --snapshot-dir (or --snapshot-store)"
        )
    reader = SnapshotReader(path.parent.parent)
    return reader, reader.resolve(snapshot_id)


@dataclasses.dataclass
class SnapshotState:
    """A verified snapshot's contents as state dicts (global tensors assembled from shards)."""

    info: SnapshotInfo
    """The snapshot (the first location's, when several hold its ranks)."""
    optimizer: dict[str, torch.Tensor]
    """``state.<fqn>.<key>`` moments."""
    extras: dict[str, Any]
    """``state.<fqn>.step`` and ``param_groups.<fqn>.<hp>``."""
    model: dict[str, torch.Tensor]
    """Whole-state snapshots: the model state dict (parameters and persistent buffers, tied
    weights under each of their keys); empty otherwise."""
    ranks: tuple[int, ...]
    """Every rank read."""


def _model_aliases(manifest: RankManifest) -> dict[str, str]:
    layouts = [TensorLayout(t.name, t.dtype, t.shape, 0, t.nbytes) for t in manifest.tensors]
    return parse_metadata(manifest.metadata_json, layouts, max_bytes=sys.maxsize).model_aliases


def read_snapshot_state(
    locations: Sequence[tuple[SnapshotReader, SnapshotInfo]], progress: Any = None
) -> SnapshotState:
    """Verify every rank's files of the snapshot ``locations`` hold (one directory, or one
    per rank's embedded server), then read and assemble them. ``progress``: a tqdm-like bar
    (``update(nbytes)``), advanced by the bytes verified and the bytes read."""
    manifests: list[tuple[SnapshotInfo, RankManifest]] = []
    for store, info in locations:
        for rank in info.ranks:  # all of the job's, or one host's share of a multi-host job
            if any(m.rank == rank for _, m in manifests):
                continue
            manifest = store.read_manifest(info, rank)
            store.verify_data(info, manifest)
            if progress is not None:
                progress.update(manifest.data_file_bytes)
            manifests.append((info, manifest))
    assembler = _Assembler()
    model = _Assembler()
    extras: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for info, manifest in manifests:
        path = info.path / manifest.data_file
        with safe_open(str(path), framework="pt") as file:
            for record in manifest.tensors:
                if is_model_tensor(record.name):
                    model.add(record.fqn or record.name[len(MODEL_PREFIX) :], record, file.get_tensor(record.name), str(path))
                elif not _is_bookkeeping(record):
                    assembler.add(_state_key(record), record, file.get_tensor(record.name), str(path))
                if progress is not None:
                    progress.update(record.nbytes)
        for fqn, value in manifest.steps.items():
            extras.setdefault(state_key(fqn, "step"), _decode_step(value))
        for fqn, group in manifest.param_groups.items():
            for hp, value in group.items():
                extras.setdefault(param_group_key(fqn, hp), _decode(value))
        aliases.update(_model_aliases(manifest))
    first = locations[0][1]
    state = assembler.finish(first)
    clash = set(state) & set(extras)
    if clash:
        raise ExportError(f"tensor keys collide with step/param-group keys: {sorted(clash)[:5]}")
    model_state = model.finish(first)
    for alias, fqn in aliases.items():
        if fqn not in model_state:
            raise ExportError(f"{first.path}: model key {alias!r} is an alias of {fqn!r}, which the snapshot lacks")
        model_state[alias] = model_state[fqn]
    ranks = tuple(sorted(m.rank for _, m in manifests))
    return SnapshotState(first, state, extras, model_state, ranks)


def _build(
    snapshot: str | os.PathLike[str], snapshot_dir: str | os.PathLike[str] | None
) -> tuple[SnapshotInfo, dict[str, torch.Tensor], dict[str, Any]]:
    """(info, state tensors, steps and param groups) of a verified snapshot."""
    state = read_snapshot_state([_resolve(snapshot, snapshot_dir)])
    return state.info, state.optimizer, state.extras


def load_flat_state_dict(
    snapshot: str | os.PathLike[str], *, snapshot_dir: str | os.PathLike[str] | None = None
) -> tuple[SnapshotInfo, dict[str, Any]]:
    """Verify a snapshot and build its flat state dict (see the module docstring).

    ``snapshot``: a snapshot directory, or with ``snapshot_dir`` an id
    (``<job>/step-<N>``, ``<job>/latest``)."""
    info, state, extras = _build(snapshot, snapshot_dir)
    return info, {**state, **extras}


def export_snapshot(
    snapshot: str | os.PathLike[str],
    out: str | os.PathLike[str],
    format: str = "torch",
    *,
    snapshot_dir: str | os.PathLike[str] | None = None,
    snapshot_store: str | None = None,
    store_timeout_s: float | None = None,
    progress: bool | None = None,
) -> ExportResult:
    """Write ``snapshot`` to ``out`` as a torch file (``format="torch"``) or a DCP directory
    (``format="dcp"``). Raises SnapshotError subclasses (not found, corrupt, ExportError).

    ``snapshot_store``: read the snapshot (an id) from this snapshot store instead, downloaded
    and verified into a temporary directory beside ``out`` (:mod:`.from_store`), removed
    afterwards; ``store_timeout_s`` bounds each request, ``progress`` its progress bar."""
    if format not in FORMATS:
        raise ExportError(f"format {format!r} is not one of {FORMATS}")
    if snapshot_store is not None:
        from swap_state.client.export.from_store import (
            STORE_TIMEOUT_S,
            check_sources,
            downloaded_snapshot,
        )

        check_sources(snapshot_dir, snapshot_store)
        timeout_s = store_timeout_s or STORE_TIMEOUT_S
        with downloaded_snapshot(snapshot_store, snapshot, out, timeout_s=timeout_s, progress=progress) as local:
            return export_snapshot(local.path, out, format)
    info, tensors, extras = _build(snapshot, snapshot_dir)
    state = {**tensors, **extras}
    out_path = pathlib.Path(out)
    if format == "torch":
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(out_path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, out_path)  # never a half-written checkpoint under the final name
    else:
        import torch.distributed.checkpoint as dcp

        out_path.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            # no_dist=True is the point here; DCP still warns that it assumes one process.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(out_path), no_dist=True)
    return ExportResult(
        info.snapshot_id, out_path, format, len(tensors), len(state), info.ranks, info.world_size
    )
