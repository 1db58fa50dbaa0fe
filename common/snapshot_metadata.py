"""The trainer's ``metadata_json`` of a snapshot: schema, encoding (trainer) and parsing (server).

The server cannot know what a segment tensor *is* (parameter, optimizer state, DTensor
shard); the trainer says so here. Manifests record it and Restore returns it rebuilt. Schema
(every top-level key optional; unknown keys kept verbatim, not interpreted)::

    {
      "tensors": {                       # keyed by *segment tensor name*
        "<name>": {"fqn": "layers.0.attn.wq.weight", "key": "exp_avg",
                   "global_shape": [4096, 4096],   # DTensor only
                   "global_offset": [0, 2048]}     # DTensor only, same length
      },
      "param_groups": {"<fqn>": {"lr": 0.001, "betas": [0.9, 0.95], "step": <value>, ...}},
      "steps": {"<fqn>": <value>},       # the optimizer step count of that parameter
      "model_aliases": {"<key>": "<fqn>"}  # whole-state: a tied model tensor's other
    }                                      # state-dict key -> the fqn it is stored under

Model tensors (``model.<fqn>``) have ``key`` ``"param"`` or ``"buffer"``. A ``<value>`` is
plain JSON or a 0-dim tensor ``{"__tensor__": 5.0, "dtype": "float32"}``. Standard JSON only
(no NaN or Infinity), at most ``MAX_METADATA_BYTES`` by default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .dtypes import DTYPE_ITEMSIZE
from .names import shorten
from .segment import TensorLayout
from .snapshot_errors import SnapshotInvalid

__all__ = [
    "BOOKKEEPING_PREFIX", "MAX_METADATA_BYTES", "TENSOR_TAG", "TensorMetadata", "SnapshotMetadata", "EMPTY_METADATA",
    "parse_metadata", "load_metadata_json", "encode_metadata", "tagged_scalar", "tensor_entry"]

MAX_METADATA_BYTES = 16 << 20
TENSOR_TAG = "__tensor__"
BOOKKEEPING_PREFIX = "swap_state."
"""Segment tensors named so, without fqn and key, hold what ``steps`` and ``param_groups`` say
per fqn: a restore at another layout does not copy them, the trainer rebuilds them."""


@dataclasses.dataclass(frozen=True)
class TensorMetadata:
    """What the trainer says about one segment tensor."""

    fqn: str | None = None
    """Parameter fqn, None when not given."""
    key: str | None = None
    """Optimizer state key (``exp_avg``, ...), None when not given."""
    global_shape: tuple[int, ...] | None = None
    """DTensor global shape, None for a plain tensor."""
    global_offset: tuple[int, ...] | None = None
    """Offset of the local shard in the global tensor, None for a plain tensor."""


def tagged_scalar(value: float, dtype: str) -> dict[str, Any]:
    """The JSON form of a 0-dim tensor: ``{"__tensor__": value, "dtype": dtype}``."""
    return {TENSOR_TAG: float(value), "dtype": dtype}


@dataclasses.dataclass(frozen=True)
class SnapshotMetadata:
    """A validated ``metadata_json``."""

    raw: str
    """The text exactly as the trainer sent it."""
    tensors: Mapping[str, TensorMetadata]
    """Per segment tensor name; tensors the trainer did not describe are absent."""
    param_groups: dict[str, Any]
    """Per fqn, the hyperparameters (JSON values)."""
    steps: dict[str, Any]
    """Per fqn, the step count (JSON value)."""
    model_aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per model state-dict key of a tied tensor, the fqn its model tensor is stored under."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The other top-level entries as sent (``model_aliases``, unknown keys)."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not standard JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e999" parses to inf, which no manifest may hold
        raise ValueError(f"{text} is out of the range of a double")
    return value


def _dims(value: Any, what: str, source: str = "metadata_json") -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise SnapshotInvalid(f"{source}: {what} must be a list of non-negative integers")
    return tuple(value)


def _check_value(value: Any, what: str) -> None:
    """A JSON value, or the tagged 0-dim tensor form."""
    if isinstance(value, dict) and TENSOR_TAG in value:
        number = value[TENSOR_TAG]
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise SnapshotInvalid(f"metadata_json: {what}: {TENSOR_TAG} must be a number")
        if value.get("dtype", "float32") not in DTYPE_ITEMSIZE:
            raise SnapshotInvalid(f"metadata_json: {what}: dtype must be one of {sorted(DTYPE_ITEMSIZE)}")


def _tensor_entry(name: str, raw: Any, layout: TensorLayout) -> TensorMetadata:
    where = f"tensors[{shorten(name)}]"
    if not isinstance(raw, dict):
        raise SnapshotInvalid(f"metadata_json: {where} must be an object")
    fqn, key = raw.get("fqn"), raw.get("key")
    for field, value in (("fqn", fqn), ("key", key)):
        if value is not None and (not isinstance(value, str) or not value):
            raise SnapshotInvalid(f"metadata_json: {where}.{field} must be a string")
    global_shape = global_offset = None
    if raw.get("global_shape") is not None:
        global_shape = _dims(raw["global_shape"], f"{where}.global_shape")
        if len(global_shape) != len(layout.shape):
            raise SnapshotInvalid(f"metadata_json: {where}.global_shape has {len(global_shape)} dims, "
                                  f"the local shape {list(layout.shape)} has {len(layout.shape)}")
    if raw.get("global_offset") is not None:
        if global_shape is None:
            raise SnapshotInvalid(f"metadata_json: {where}.global_offset needs global_shape")
        global_offset = _dims(raw["global_offset"], f"{where}.global_offset")
        if len(global_offset) != len(global_shape):
            raise SnapshotInvalid(f"metadata_json: {where}.global_offset and global_shape differ in length")
    return TensorMetadata(fqn, key, global_shape, global_offset)


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SnapshotInvalid(f"metadata_json: {what} must be an object")
    return value


def load_metadata_json(text: str, what: str = "metadata_json", max_bytes: int = MAX_METADATA_BYTES) -> dict[str, Any]:
    """``text`` as a standard JSON object of at most ``max_bytes`` (empty: ``{}``); SnapshotInvalid naming ``what``."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise SnapshotInvalid(f"{what} is {size} bytes, more than the limit of {max_bytes}")
    try:
        raw = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float) if text.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise SnapshotInvalid(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SnapshotInvalid(f"{what} must be a JSON object")
    return raw


EMPTY_METADATA = SnapshotMetadata("", {}, {}, {})
"""A snapshot's metadata when its trainer sent none."""


def parse_metadata(metadata_json: str, tensors: Sequence[TensorLayout], max_bytes: int = MAX_METADATA_BYTES,
                   what: str = "metadata_json") -> SnapshotMetadata:
    """Validate ``metadata_json`` against the segment's tensors (SnapshotInvalid otherwise;
    ``what`` names the text where its size or syntax is wrong)."""
    raw = load_metadata_json(metadata_json, what, max_bytes)
    by_name = {t.name: t for t in tensors}
    entries: dict[str, TensorMetadata] = {}
    for name, entry in _object(raw.get("tensors"), "tensors").items():
        if name not in by_name:
            raise SnapshotInvalid(f"metadata_json: tensors names {shorten(name)}, not a segment tensor")
        entries[name] = _tensor_entry(name, entry, by_name[name])
    param_groups = _object(raw.get("param_groups"), "param_groups")
    for fqn, group in param_groups.items():
        for hp, value in _object(group, f"param_groups[{shorten(fqn)}]").items():
            _check_value(value, f"param_groups[{shorten(fqn)}][{shorten(hp)}]")
    steps = _object(raw.get("steps"), "steps")
    for fqn, value in steps.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not abs(value) <= sys.float_info.max:  # NaN, inf, and an int no double holds
                raise SnapshotInvalid(f"metadata_json: steps[{shorten(fqn)}] must be finite")
            continue
        if not (isinstance(value, dict) and TENSOR_TAG in value):
            raise SnapshotInvalid(f"metadata_json: steps[{shorten(fqn)}] must be a number or a tensor")
        _check_value(value, f"steps[{shorten(fqn)}]")
    aliases = _object(raw.get("model_aliases"), "model_aliases")
    for alias, fqn in aliases.items():
        if not isinstance(fqn, str) or not fqn:
            raise SnapshotInvalid(f"metadata_json: model_aliases[{shorten(alias)}] must be a string")
    extra = {key: value for key, value in raw.items() if key not in _MANIFEST_FIELDS}
    return SnapshotMetadata(metadata_json, entries, param_groups, steps, aliases, extra)


_MANIFEST_FIELDS = ("tensors", "param_groups", "steps")  # a manifest's own fields; the rest: extra


def tensor_entry(tensor: TensorMetadata | Any) -> dict[str, Any]:
    """A tensor's ``tensors`` entry, of a TensorMetadata or anything with its attributes."""
    entry: dict[str, Any] = {name: value for name in ("fqn", "key") if (value := getattr(tensor, name)) is not None}
    if tensor.global_shape is not None:
        entry.update(global_shape=list(tensor.global_shape), global_offset=list(tensor.global_offset or ()))
    return entry


def encode_metadata(tensors: Mapping[str, TensorMetadata], param_groups: Mapping[str, Mapping[str, Any]],
                    steps: Mapping[str, Any], model_aliases: Mapping[str, str] | None = None) -> str:
    """The ``metadata_json`` a trainer sends: the inverse of :func:`parse_metadata` (values
    JSON-ready, or :func:`tagged_scalar`)."""
    raw: dict[str, Any] = {"tensors": {name: tensor_entry(t) for name, t in tensors.items()},
                           "steps": dict(steps),
                           "param_groups": {k: dict(g) for k, g in param_groups.items()}}
    if model_aliases:
        raw["model_aliases"] = dict(model_aliases)
    return json.dumps(raw, allow_nan=False)
