"""Validation of request values, first thing in every RPC, before any reaches the domain (which
trusts them). Every check raises InvalidRequestError naming the field and the rule, quoting the
value with :func:`~swap_state.common.names.shorten` (the message travels back as gRPC metadata,
which a hostile 20,000-character id must not overflow).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from swap_state.common.dtypes import DTYPE_ITEMSIZE
from swap_state.common.errors import InvalidRequestError
from swap_state.common.segment import TensorSpec
from swap_state.common.segment_descriptor import SegmentDescriptor
from swap_state.common.snapshot_format import DATA_ALIGN
from swap_state.common.names import MODEL_PREFIX, is_model_tensor, parse_snapshot_id, shorten, validate_job_id

__all__ = [
    "MAX_NDIM", "MAX_SEGMENT_BYTES", "MAX_STEP", "MAX_WORLD_SIZE", "SAFETENSORS_MAX_HEADER_BYTES",
    "validate_client_host", "validate_descriptor", "validate_job_id", "validate_local_world_size", "validate_rank",
    "validate_session", "validate_snapshot_id", "validate_snapshot_rank", "validate_step", "validate_tensor_specs"]

_TENSOR_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,512}")
_SESSION_ID = re.compile(r"[0-9a-f]{32}")
MAX_WORLD_SIZE = 1 << 20
MAX_NDIM = 32
# Above this a request is nonsense rather than merely over budget (1 PiB).
MAX_SEGMENT_BYTES = 1 << 50
# COMMITTED_STEP stores step + 1 in a uint64 header word; int64 range keeps clients sane.
MAX_STEP = (1 << 63) - 2
# The safetensors library refuses a header over this many bytes (its N_MAX_HEADER).
SAFETENSORS_MAX_HEADER_BYTES = 100_000_000
# A header entry is '"<name>":{"dtype":"BF16","shape":[<dims>],"data_offsets":[<a>,<b>]},':
# at most this much besides the name, with numbers of 20 digits at most.
_HEADER_BYTES_PER_TENSOR = 50 + 2 * 20
_HEADER_BYTES_PER_DIM = 21
# Stands in for the session's job while only the form of a relative snapshot id is checked.
_SOME_JOB = "job"


def validate_rank(rank: int, world_size: int) -> None:
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidRequestError(f"world_size {world_size} must be in [1, {MAX_WORLD_SIZE}]")
    if not 0 <= rank < world_size:
        raise InvalidRequestError(f"rank {rank} must be < world_size {world_size}")


def validate_local_world_size(local_world_size: int, world_size: int) -> int:
    """The ranks of the job on this server; 0 (clients without the field) means ``world_size``."""
    if local_world_size == 0:
        return world_size
    if not 1 <= local_world_size <= world_size:
        raise InvalidRequestError(f"local_world_size {local_world_size} must be in [1, world_size {world_size}] "
                              "(0: the whole job on this server)")
    return local_world_size


def validate_session(session_id: str, generation: int) -> None:
    """The (session_id, generation) pair every call after Attach carries."""
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidRequestError(f"session_id {shorten(session_id)} is not a session id issued by this server")
    if generation <= 0:
        raise InvalidRequestError("generation is required (the value Attach returned)")


def validate_snapshot_rank(rank: int) -> None:
    """A rank named without its world size (SnapshotStatus): at least in range."""
    if not 0 <= rank < MAX_WORLD_SIZE:
        raise InvalidRequestError(f"rank {rank} must be in [0, {MAX_WORLD_SIZE})")


def validate_snapshot_id(snapshot_id: str, *, relative: bool, latest: bool) -> str:
    """The form of a snapshot id: ``<job>/step-<N>`` (any zero padding), ``<job>/latest`` when
    ``latest``, and without ``<job>/`` when ``relative``. Returns its short spelling
    (``step-25``), still relative when it was."""
    ref = parse_snapshot_id(snapshot_id, _SOME_JOB if relative else None)
    if ref.latest and not latest:
        raise InvalidRequestError(f"snapshot id {shorten(snapshot_id)} is not '<job>/step-<N>' (e.g. demo/step-25)")
    name = "latest" if ref.latest else f"step-{ref.step}"
    return f"{ref.job_id}/{name}" if "/" in snapshot_id else name


def validate_step(step: int) -> None:
    if not 0 <= step <= MAX_STEP:
        raise InvalidRequestError(f"step {step} out of range [0, {MAX_STEP}]")


def validate_client_host(host: str) -> None:
    if len(host) > 255 or not host.isprintable():
        raise InvalidRequestError("client_host must be at most 255 printable characters")


def validate_tensor_specs(specs: Iterable[tuple[str, str, Sequence[int]]], *, max_tensors: int,
                          max_total_bytes: int = MAX_SEGMENT_BYTES) -> list[TensorSpec]:
    """Names unique and well formed, dtypes known, dims >= 0, sizes bounded (over
    ``max_total_bytes`` is nonsense; over the free budget is the arena's RESOURCE_EXHAUSTED)."""
    out: list[TensorSpec] = []
    seen: set[str] = set()
    model_from: int | None = None  # the first model tensor's index (they must come last)
    total = 0
    header_bound = DATA_ALIGN  # the rank file's safetensors header (snapshot_format): its padding first
    name_ok = _TENSOR_NAME.fullmatch
    # Hot loop (up to max_tensors iterations): the valid case does as little work as possible.
    for index, (name, dtype, shape) in enumerate(specs):
        if index >= max_tensors:
            raise InvalidRequestError(f"too many tensors: at most {max_tensors} per segment")
        if name in seen or not name_ok(name):
            raise _bad_name(index, name, seen)
        seen.add(name)
        if is_model_tensor(name):
            model_from = index if model_from is None else model_from
        elif model_from is not None:
            raise InvalidRequestError(f"tensors[{index}] ({shorten(name)}) follows model tensor {model_from}: the "
                                  f"model tensors ({MODEL_PREFIX}*) must come after every other tensor")
        itemsize = DTYPE_ITEMSIZE.get(dtype)
        if itemsize is None:
            raise InvalidRequestError(f"tensors[{index}] ({name}): unknown dtype {shorten(dtype)}; "
                                      f"expected one of {', '.join(DTYPE_ITEMSIZE)}")
        dims = tuple(map(int, shape))
        if len(dims) > MAX_NDIM:
            raise InvalidRequestError(f"tensors[{index}] ({name}): more than {MAX_NDIM} dims")
        if dims and min(dims) < 0:
            raise InvalidRequestError(f"tensors[{index}] ({name}): negative dim in shape {list(dims)}")
        # At most 32 dims below 2**63 each: the product is a big int, never an overflow.
        total += math.prod(dims) * itemsize
        if total > max_total_bytes:
            raise InvalidRequestError(f"tensors[{index}] ({name}) shape {list(dims)[:8]}: the tensors exceed the "
                                  f"largest possible segment ({max_total_bytes} bytes)")
        header_bound += len(name) + _HEADER_BYTES_PER_TENSOR + _HEADER_BYTES_PER_DIM * len(dims)
        out.append((name, dtype, dims))
    if header_bound > SAFETENSORS_MAX_HEADER_BYTES:
        raise InvalidRequestError(f"{len(out)} tensors would give the snapshot file a safetensors header of up to "
                              f"{header_bound} bytes, over the {SAFETENSORS_MAX_HEADER_BYTES} bytes safetensors "
                              "readers accept: fewer tensors per rank (shard the model over more ranks)")
    return out


# The refusals' messages, out of validate_tensor_specs' hot loop (called only on a refusal).
def _bad_name(index: int, name: str, seen: set[str]) -> InvalidRequestError:
    if name in seen:
        return InvalidRequestError(f"tensors[{index}].name {shorten(name)} is duplicated")
    return InvalidRequestError(f"tensors[{index}].name {shorten(name)} is invalid: use 1-512 characters of "
                           "[A-Za-z0-9_.:/-]")


def validate_descriptor(descriptor: SegmentDescriptor, *, max_tensors: int) -> list[TensorSpec]:
    """The checks of an Attach and an Allocate, on a previous server's descriptor; its tensor specs."""
    validate_job_id(descriptor.job_id)
    validate_rank(descriptor.rank, descriptor.world_size)
    if validate_local_world_size(descriptor.local_world_size, descriptor.world_size) != descriptor.local_world_size:
        raise InvalidRequestError("local_world_size 0 in a segment descriptor")
    return validate_tensor_specs(descriptor.tensors, max_tensors=max_tensors)
