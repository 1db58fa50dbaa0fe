"""``swap-state export``: a snapshot as the seed's flat optimizer state dict (``state.<fqn>.<key>`` global tensors,
``state.<fqn>.step``, ``param_groups.<fqn>.<hp>``), a ``torch.save`` file or a DCP directory, loadable without
swap-state. Every read is checked by its :class:`~swap_state.common.snapshot_tier.SnapshotTier`; shards are assembled
with every element covered, or the export is refused naming the ranks present (one host's snapshot of a multi-host job).
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
from swap_state.client.remote.segment_mapping import TORCH_DTYPES
from swap_state.common.names import (
    MODEL_PREFIX, STATE_PREFIX, is_model_tensor, param_group_key, parse_snapshot_id, state_key)
from swap_state.common.object_store import STORE_FLAG, STORE_TIMEOUT_S, PosixObjectStore, open_store
from swap_state.common.segment import TensorLayout
from swap_state.common.snapshot_errors import SnapshotError, SnapshotNotFoundError, StoreUnavailableError
from swap_state.common.snapshot_format import TensorRecord
from swap_state.common.snapshot_metadata import BOOKKEEPING_PREFIX, TENSOR_TAG, parse_metadata
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier
from swap_state.common.stored_snapshots import StoredSnapshots
from tqdm import tqdm

__all__ = ["FORMATS", "ExportError", "ExportResult", "SnapshotState", "export_snapshot", "locate",
           "read_snapshot_state"]

FORMATS = ("torch", "dcp")

Location = tuple[SnapshotTier, SnapshotInfo]


class ExportError(SnapshotError):
    """The snapshot cannot be exported (e.g. shards leave holes, or a store or flag stands in the way)."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`export_snapshot` wrote."""

    snapshot_id: str
    out: pathlib.Path  # the file (torch) or directory (dcp, torchtitan) written
    format: str  # torch, dcp or torchtitan
    tensors: int  # number of state.<fqn>.<key> tensors
    entries: int  # number of keys in the optimizer's flat state dict
    ranks: tuple[int, ...] = ()  # the ranks exported: those the snapshot holds
    world_size: int = 0  # the job's world size (above len(ranks): one host's snapshot)
    model_tensors: int = 0  # keys of the model's state dict written (torchtitan)


def _decode(value: Any) -> Any:
    """Manifest JSON -> state-dict value: tagged 0-dim tensors, lists back to tuples (torch keeps betas as one)."""
    if isinstance(value, dict):
        if TENSOR_TAG in value:
            return torch.tensor(value[TENSOR_TAG], dtype=TORCH_DTYPES[value.get("dtype", "float32")])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def _decode_step(value: Any) -> torch.Tensor:
    decoded = _decode(value)
    return decoded if isinstance(decoded, torch.Tensor) else torch.tensor(float(decoded), dtype=torch.float32)


def _state_key(tensor: TensorRecord) -> str | None:
    """``state.<fqn>.<key>``, else ``state.<segment tensor name>``; None for the container's own step
    vectors (the manifest's ``steps`` and ``param_groups`` carry their values)."""
    if tensor.fqn and tensor.key:
        return state_key(tensor.fqn, tensor.key)
    return None if tensor.name.startswith(BOOKKEEPING_PREFIX) else STATE_PREFIX + tensor.name


def _tensor(data: bytes, record: TensorRecord) -> torch.Tensor:
    dtype = TORCH_DTYPES[record.dtype]
    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(record.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(record.shape)


class _Assembler:
    """Global tensors built from shards, with a coverage mask per sharded tensor."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.covered: dict[str, torch.Tensor] = {}
        self.sources: dict[str, str] = {}

    def add(self, key: str, record: TensorRecord, local: torch.Tensor, where: str) -> None:
        if record.global_shape is None:  # replicated (DDP) on each rank: the lowest rank's is kept
            kept = self.values.setdefault(key, local)
            self.sources.setdefault(key, where)
            if tuple(kept.shape) != tuple(local.shape):
                raise ExportError(f"{where}: {key} has shape {list(local.shape)}, another rank's is "
                                  f"{list(kept.shape)} ({self.sources[key]})")
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
            raise ExportError(f"{where}: shard {record.name!r} of shape {list(local.shape)} at offset "
                              f"{list(offset)} exceeds global shape {list(shape)}")
        region = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
        target[region] = local
        self.covered[key][region] = True

    def finish(self, info: SnapshotInfo) -> dict[str, torch.Tensor]:
        for key, mask in self.covered.items():
            if not bool(mask.all()):
                cover = f"cover {int(mask.sum())} of {mask.numel()} elements of the global tensor"
                if info.index.complete_job:
                    raise ExportError(f"{key}: the shards of all ranks {cover}")
                raise ExportError(f"{key}: the shards of the {info.describe_ranks()} in {info.path} {cover}; the "
                                  "other ranks' shards are in the snapshots of the same step on the other hosts' "
                                  "servers, so this host's snapshot alone cannot be exported as a full state dict")
        return self.values


def locate(snapshot: str | os.PathLike[str], snapshot_dir: str | os.PathLike[str] | None = None,
           snapshot_store: str | None = None, timeout_s: float | None = None) -> list[Location]:
    """Where the snapshot's ranks are: an id (or its URI there, as ``swap-state snapshots`` prints it) in the store
    ``snapshot_store``; an id under ``snapshot_dir`` itself or, as the embedded servers of a multi-rank job keep them,
    in each ``rank-*`` directory below it; else a snapshot directory ``<snapshot-dir>/<job>/step-<N>`` (the step in
    either spelling: ``step-000000000025`` or ``step-25``) or ``<snapshot-dir>/<job>/latest``. ConfigError for a URI
    that names no store."""
    if snapshot_dir is not None and snapshot_store is not None:
        raise ExportError(f"give one of --snapshot-dir and {STORE_FLAG}, not both")
    if snapshot_store is not None:
        store = open_store(snapshot_store, timeout_s or STORE_TIMEOUT_S)
        if isinstance(store, PosixObjectStore) and not store.root.is_dir():
            raise StoreUnavailableError(f"{STORE_FLAG} {snapshot_store}: {store.root} is not a directory")
        stored = StoredSnapshots(store)
        return [(stored, stored.resolve(os.fspath(snapshot).removeprefix(snapshot_store.rstrip("/") + "/")))]
    if snapshot_dir is None:
        path = pathlib.Path(os.path.abspath(snapshot))
        snapshot, snapshot_dir = f"{path.parent.name}/{path.name}", path.parent.parent
        try:
            parse_snapshot_id(snapshot, error=ExportError)
            found = path.is_dir() or path.parent.is_dir()
        except ExportError:
            found = False
        if not found:
            raise ExportError(f"{path} is not a snapshot directory (<snapshot-dir>/<job>/step-<N>, e.g. "
                              "/snapshots/demo/step-25 or /snapshots/demo/step-000000000025); an id such as "
                              "demo/step-25 needs --snapshot-dir (or --snapshot-store)")
    snapshot_id, root = os.fspath(snapshot), pathlib.Path(snapshot_dir)
    job = parse_snapshot_id(snapshot_id, error=ExportError).job_id
    if not root.is_dir():
        raise SnapshotNotFoundError(f"--snapshot-dir {root} is not a directory")
    roots = [root] if (root / job).is_dir() else sorted(root.glob("rank-*"))
    readers = [SnapshotReader(r) for r in roots if (r / job).is_dir()]
    if not readers:
        raise SnapshotNotFoundError(f"snapshot {snapshot_id} is not in {root} (no {job}/ there, nor in rank-*/ below it): "
                               "pass the --snapshot-dir of the server that took it (an embedded server under "
                               "torchtitan keeps them in <job.dump_folder>/swap-state-snapshots)")
    return [(reader, reader.resolve(snapshot_id)) for reader in readers]


@dataclasses.dataclass
class SnapshotState:
    """A verified snapshot's contents as state dicts (global tensors assembled from shards)."""

    info: SnapshotInfo  # the snapshot (the first location's, when several hold its ranks)
    optimizer: dict[str, torch.Tensor]  # state.<fqn>.<key> moments
    extras: dict[str, Any]  # state.<fqn>.step and param_groups.<fqn>.<hp>
    # Whole-state snapshots: the model state dict (parameters and persistent buffers, tied
    # weights under each of their keys); empty otherwise.
    model: dict[str, torch.Tensor]
    ranks: tuple[int, ...]  # every rank read

    @property
    def flat(self) -> dict[str, Any]:
        """The optimizer's flat state dict: moments, steps and param groups."""
        return {**self.optimizer, **self.extras}


def read_snapshot_state(locations: Sequence[Location], progress: bool | None = False) -> SnapshotState:
    """Read every rank of the snapshot ``locations`` hold (:func:`locate`), each read checked
    by its tier, and assemble it. ``progress``, a bar of the bytes read: None shows it on a
    terminal once the read takes over a second; True always; False never."""
    disable = False if progress else None if progress is None else True
    optimizer, model = _Assembler(), _Assembler()
    extras: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    ranks: list[int] = []
    with tqdm(total=sum(info.bytes for _, info in locations), unit="B", unit_scale=True, delay=1.0,
              desc=f"export {locations[0][1].snapshot_id}", disable=disable) as bar:
        for tier, info in locations:
            for rank in info.ranks:  # all of the job's, or one host's share of a multi-host job
                if rank in ranks:
                    continue
                ranks.append(rank)
                manifest = tier.read_manifest(info, rank)
                tier.check_data_header(info, manifest)
                where = str(info.path / manifest.data_file)
                for record in manifest.tensors:
                    tensor = _tensor(tier.read_tensor(info, manifest, record), record)
                    if is_model_tensor(record.name):
                        model.add(record.fqn or record.name[len(MODEL_PREFIX) :], record, tensor, where)
                    elif (key := _state_key(record)) is not None:
                        optimizer.add(key, record, tensor, where)
                    bar.update(record.nbytes)
                for fqn, value in manifest.steps.items():
                    extras.setdefault(state_key(fqn, "step"), _decode_step(value))
                for fqn, group in manifest.param_groups.items():
                    for hp, value in group.items():
                        extras.setdefault(param_group_key(fqn, hp), _decode(value))
                layouts = [TensorLayout(t.name, t.dtype, t.shape, 0, t.nbytes) for t in manifest.tensors]
                aliases.update(parse_metadata(manifest.metadata_json, layouts, max_bytes=sys.maxsize).model_aliases)
    first = locations[0][1]
    state = optimizer.finish(first)
    clash = set(state) & set(extras)
    if clash:
        raise ExportError(f"tensor keys collide with step/param-group keys: {sorted(clash)[:5]}")
    model_state = model.finish(first)
    for alias, fqn in aliases.items():
        if fqn not in model_state:
            raise ExportError(f"{first.path}: model key {alias!r} is an alias of {fqn!r}, which the snapshot lacks")
        model_state[alias] = model_state[fqn]
    return SnapshotState(first, state, extras, model_state, tuple(sorted(ranks)))


def save_dcp(state: dict[str, Any], path: pathlib.Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # no_dist=True is the point here; DCP still warns that it assumes one process.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def export_snapshot(snapshot: str | os.PathLike[str], out: str | os.PathLike[str], format: str = "torch", *,
                    snapshot_dir: str | os.PathLike[str] | None = None, snapshot_store: str | None = None,
                    store_timeout_s: float | None = None, progress: bool | None = None) -> ExportResult:
    """Write ``snapshot`` (found as :func:`locate` finds it) to ``out`` as a torch file or a DCP
    directory; raises SnapshotError subclasses (not found, corrupt, ExportError)."""
    if format not in FORMATS:
        raise ExportError(f"format {format!r} is not one of {FORMATS}")
    read = read_snapshot_state(locate(snapshot, snapshot_dir, snapshot_store, store_timeout_s), progress)
    state = read.flat
    out_path = pathlib.Path(out)
    if format == "torch":
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(out_path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, out_path)  # never a half-written checkpoint under the final name
    else:
        out_path.mkdir(parents=True, exist_ok=True)
        save_dcp(state, out_path)
    return ExportResult(read.info.snapshot_id, out_path, format, len(read.optimizer), len(state), read.ranks,
                        read.info.world_size)
