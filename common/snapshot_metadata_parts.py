"""A snapshot's ``metadata_json`` in two parts, so a snapshot costs the same at 60 or 6,000 tensors: a *base* that does
not change between a session's snapshots, sent once, and a *delta*, sent every time. The server expands them (in the
writer, after the trainer's stall) into exactly the ``metadata_json`` the trainer would have sent whole.

Base (the full schema's ``tensors`` and ``model_aliases``, plus)::

    {"tensors": {...}, "model_aliases": {...},
     "fqns": ["<fqn of parameter 0>", ...],    # per parameter, in the segment's order
     "groups": [<param group index of parameter 0>, ...]}

Delta::

    {"group_params": [{"lr": 0.001, ...}, ...],  # per param group: its hyperparameters
     "steps": [<step count of parameter 0>, ...]}  # or one number: every parameter's

Call order: the trainer :func:`encode_base` once (id :func:`base_id`), then per snapshot
:func:`encode_delta`; the server :func:`parse_base` once, then per snapshot :func:`parse_delta`
(no per-tensor work) and, in the writer, :meth:`MetadataParts.expand`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .segment import TensorLayout
from .snapshot_errors import SnapshotInvalid
from .snapshot_metadata import (
    MAX_METADATA_BYTES, SnapshotMetadata, TensorMetadata, _check_value, _dims, encode_metadata, load_metadata_json,
    parse_metadata, tensor_entry)

__all__ = ["MetadataBase", "MetadataParts", "base_id", "encode_base", "encode_delta", "parse_base", "parse_delta"]


@dataclasses.dataclass(frozen=True)
class MetadataBase:
    """A validated base: what does not change between a session's snapshots."""

    tensors: Mapping[str, TensorMetadata]
    model_aliases: dict[str, str]
    fqns: tuple[str, ...]
    groups: tuple[int, ...]
    """Per parameter, the index of its param group in the delta's ``group_params``."""
    group_count: int
    """One more than the largest group index (0 without parameters)."""


@dataclasses.dataclass(frozen=True)
class MetadataParts:
    """A base and a delta that fit it: a snapshot's metadata, not yet expanded."""

    base: MetadataBase
    group_params: tuple[dict[str, Any], ...]
    steps: tuple[Any, ...]

    def expand(self) -> SnapshotMetadata:
        """The metadata the whole ``metadata_json`` would have given (per-parameter work)."""
        base = self.base
        param_groups = {fqn: self.group_params[g] for fqn, g in zip(base.fqns, base.groups)}
        steps = dict(zip(base.fqns, self.steps))
        raw = encode_metadata(base.tensors, param_groups, steps, base.model_aliases)
        aliases = dict(base.model_aliases)
        return SnapshotMetadata(raw, base.tensors, param_groups, steps, aliases,
                                {"model_aliases": aliases} if aliases else {})


def encode_base(tensors: Mapping[str, TensorMetadata], model_aliases: Mapping[str, str] | None, fqns: Sequence[str],
                groups: Sequence[int]) -> str:
    """The base a trainer sends once (its fields as :func:`encode_metadata` writes them)."""
    return json.dumps({"tensors": {name: tensor_entry(t) for name, t in tensors.items()},
                       "model_aliases": dict(model_aliases or {}), "fqns": list(fqns),
                       "groups": [int(g) for g in groups]}, allow_nan=False)


def base_id(base_json: str) -> str:
    """The name a snapshot gives its base by: a digest of its text."""
    return hashlib.sha256(base_json.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def encode_delta(group_params: Sequence[Mapping[str, Any]], steps: Sequence[Any] | float) -> str:
    """A snapshot's delta: per group its hyperparameters (JSON values), per parameter its step
    (or one number, every parameter's step)."""
    steps = steps if isinstance(steps, (int, float)) else list(steps)
    return json.dumps({"group_params": [dict(g) for g in group_params], "steps": steps}, allow_nan=False)


def parse_base(base_json: str, tensors: Sequence[TensorLayout], max_bytes: int = MAX_METADATA_BYTES) -> MetadataBase:
    """Validate a base against the segment's tensors; SnapshotInvalid otherwise."""
    whole = parse_metadata(base_json, tensors, max_bytes, "metadata base")
    fqns = whole.extra.get("fqns", [])  # unknown keys of the full schema: kept in extra
    if not isinstance(fqns, list) or not all(isinstance(f, str) and f for f in fqns):
        raise SnapshotInvalid("metadata base: fqns must be a list of non-empty strings")
    groups = _dims(whole.extra.get("groups", []), "groups", "metadata base")
    if len(groups) != len(fqns):
        raise SnapshotInvalid(f"metadata base: {len(fqns)} fqns but {len(groups)} group indices")
    return MetadataBase(whole.tensors, dict(whole.model_aliases), tuple(fqns), groups, max(groups, default=-1) + 1)


def parse_delta(delta_json: str, base: MetadataBase, max_bytes: int = MAX_METADATA_BYTES) -> MetadataParts:
    """Validate a delta against its base (no per-tensor work); SnapshotInvalid otherwise."""
    raw = load_metadata_json(delta_json, "metadata delta", max_bytes)
    group_params = raw.get("group_params", [])
    if not isinstance(group_params, list) or not all(isinstance(g, dict) for g in group_params):
        raise SnapshotInvalid("metadata delta: group_params must be a list of objects")
    if len(group_params) < base.group_count:
        raise SnapshotInvalid(f"metadata delta: {len(group_params)} param groups, the base names "
                              f"{base.group_count}")
    for index, group in enumerate(group_params):
        for name, value in group.items():
            _check_value(value, f"group_params[{index}][{name[:40]}]")
    steps = raw.get("steps", [])
    if isinstance(steps, (int, float)) and not isinstance(steps, bool):  # the common case
        return MetadataParts(base, tuple(group_params), (steps,) * len(base.fqns))  # finite: loaded
    if not isinstance(steps, list) or len(steps) != len(base.fqns):
        raise SnapshotInvalid(f"metadata delta: steps must be a list of {len(base.fqns)} values")
    for index, value in enumerate(steps):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _check_value(value, f"steps[{index}]")
            if not isinstance(value, dict):
                raise SnapshotInvalid(f"metadata delta: steps[{index}] must be a number or a tensor")
    return MetadataParts(base, tuple(group_params), tuple(steps))
