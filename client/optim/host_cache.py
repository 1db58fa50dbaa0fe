"""The host cache: where a parameter's Adam moments and step live between steps.

``param_to_cpu_states_map[param]`` holds every key of :data:`MOMENT_KEYS` (a CPU tensor shaped
like the local shard, or None where the group does not use it) and :data:`STEP_KEY` (a 0-dim
:data:`STEP_DTYPE` tensor); ``optimizer.state[param]`` only zero-storage placeholders, so that
torch code inspecting the state sees the usual keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

# DCP's canonical FQNs (strips activation-checkpoint / compile / DDP prefixes)
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.optim import Optimizer

from swap_state.client.host_register import PAGE_SIZE
from swap_state.client.optim.dtensor_utils import DTensor, unwrap_dtensor, wrap_like_param

__all__ = [
    "FLAT_ALIGN", "FLAT_PAGE_RUN", "MOMENT_KEYS", "STEP_DTYPE", "STEP_KEY", "HostCache", "HostCacheEntry",
    "HostCaches", "SliceStates", "advance_group_step", "as_number", "device_placeholders",
    "flat_host_caches", "flat_layout", "fqns_by_param", "group_map", "has_data", "host_cache_ready",
    "moment_keys", "param_fqns", "placeholder_like", "step_tensor", "steps_vector"]

#: Adam state tensors shaped like the parameter, in host-cache order.
MOMENT_KEYS: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: Per-parameter step count, kept in the host cache next to the moments.
STEP_KEY = "step"
#: torch's fused Adam keeps ``step`` as a float32 scalar.
STEP_DTYPE = torch.float32

HostCache = dict[str, torch.Tensor | None]

#: Alignment of a tensor in a flat host buffer (:func:`flat_layout`): a cache line and a sector.
FLAT_ALIGN = 512
#: A tensor of at least this many pages starts on a page instead: registration chunks end
#: only on page boundaries between tensors, which large tensors must leave (waste < 1/64).
FLAT_PAGE_RUN = 64


@dataclass(frozen=True, eq=False)
class HostCacheEntry:
    """What a moment store allocates for one parameter: ``keys`` of the local shard's shape and dtype, and a step."""

    param: torch.Tensor
    fqn: str
    keys: tuple[str, ...]
    shape: torch.Size
    dtype: torch.dtype
    optimizer_index: int
    group_index: int

    @property
    def nbytes(self) -> int:
        """Bytes of the moments (the step is not counted)."""
        return len(self.keys) * self.shape.numel() * self.dtype.itemsize


def moment_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    """The moments a param group's parameters have: ``max_exp_avg_sq`` only with amsgrad."""
    return MOMENT_KEYS if group.get("amsgrad", False) else MOMENT_KEYS[:2]


def group_map(optim: Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """``optim.param_to_group_map`` as torch builds it."""
    return {param: group for group in optim.param_groups for param in group["params"]}


def has_data(tensor: torch.Tensor) -> bool:
    """False for a swapped-out placeholder (elements but no storage)."""
    return tensor.numel() == 0 or tensor.untyped_storage().size() > 0


def step_tensor(value: float) -> torch.Tensor:
    """A new step count as torch's fused Adam keeps it."""
    return torch.tensor(float(value), dtype=STEP_DTYPE)


def as_number(value: Any) -> float:
    """A step or hyperparameter (number or one-element tensor) as a float."""
    if isinstance(value, torch.Tensor):
        return float(unwrap_dtensor(value).item())
    return float(value)


def advance_group_step(group: dict[str, Any]) -> None:
    """The group's step counts container steps (the seed keeps it; checkpoints carry it)."""
    step = group.get(STEP_KEY)
    if isinstance(step, torch.Tensor):
        step += 1
    else:
        group[STEP_KEY] = step_tensor(as_number(step or 0) + 1)


def host_cache_ready(host: Mapping[str, Any] | None, group: Mapping[str, Any], local_param: Any = None,
                     dtype: torch.dtype | None = None) -> bool:
    """Whether ``host`` holds every moment ``group`` needs, with data (and ``local_param``'s layout)."""
    if not host:
        return False
    for key in moment_keys(group):
        tensor = host.get(key)
        if not isinstance(tensor, torch.Tensor) or not has_data(tensor):
            return False
        if local_param is not None and (tensor.shape, tensor.dtype) != (local_param.shape, dtype or local_param.dtype):
            return False
    return True


@dataclass(eq=False)
class HostCaches:
    """Builds, checks and installs the host caches (``cpu_states``) of ``optimizers`` and their placeholders
    (``device_states``); ``store`` allocates them."""

    store: Any
    optimizers: Sequence[Optimizer]
    cpu_states: dict[torch.Tensor, HostCache]
    device_states: dict[torch.Tensor, dict[str, Any]]
    moment_dtype: torch.dtype | None
    epoch: int = 0
    """Counts :meth:`install` calls (the step pipeline's plans are built against one)."""

    def entries(self, optimizer_index: int, model: nn.Module, optim: Optimizer,
                pairs: Iterable[tuple[int, torch.Tensor]]) -> list[HostCacheEntry]:
        """Entries for ``(group_index, param)`` pairs of ``optim``, in the given order."""
        fqns = fqns_by_param(model)
        entries = []
        for group_index, param in pairs:
            fqn = param_fqns(fqns, param, optimizer_index)[0]
            local = unwrap_dtensor(param)
            if not local.is_contiguous():
                # The fused kernel walks memory linearly: another layout pairs the wrong elements.
                raise ValueError(f"parameter {fqn!r} is not contiguous; the swap optimizer needs contiguous parameters")
            keys, dtype = moment_keys(optim.param_groups[group_index]), self.moment_dtype or local.dtype
            entries.append(HostCacheEntry(param, fqn, keys, local.shape, dtype, optimizer_index, group_index))
        return entries

    @staticmethod
    def checked(entry: HostCacheEntry, tensors: Mapping[str, Any] | None) -> HostCache:
        """``tensors`` the store allocated, checked against ``entry``, in map format."""
        if tensors is None:
            raise ValueError(f"the moment store allocated no cache for {entry.fqn!r}")
        expected = {key: (entry.shape, entry.dtype) for key in entry.keys}
        expected[STEP_KEY] = (torch.Size(()), STEP_DTYPE)
        for key, (shape, dtype) in expected.items():
            tensor = tensors.get(key)
            if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
                raise ValueError(f"host cache of {entry.fqn!r} has no tensor under {key!r}")
            if tensor.device.type != "cpu" or tensor.shape != shape or tensor.dtype != dtype:
                raise ValueError(f"host cache {entry.fqn!r}.{key}: expected a CPU {dtype} tensor of shape "
                                 f"{tuple(shape)}, got {tensor.device} {tensor.dtype} {tuple(tensor.shape)}")
            if not tensor.is_contiguous() or not has_data(tensor):
                raise ValueError(f"host cache {entry.fqn!r}.{key} must be contiguous and have storage")
        return {key: tensors[key] if key in entry.keys else None for key in MOMENT_KEYS} | {STEP_KEY: tensors[STEP_KEY]}

    def install(self, entries: Sequence[HostCacheEntry]) -> None:
        """Allocate, check (all first) and install caches for ``entries``, with placeholders."""
        if not entries:
            return
        self.epoch += 1
        allocated = self.store.allocate(entries, self.optimizers)
        checked = [(entry, self.checked(entry, allocated.get(entry.param))) for entry in entries]
        for entry, host in checked:
            self.set(entry, host)

    def set(self, entry: HostCacheEntry, host: HostCache, placeholders: dict[str, Any] | None = None) -> None:
        """Make ``host`` ``entry.param``'s cache, ``placeholders`` (default: built now) its ``optimizer.state``."""
        self.cpu_states[entry.param] = host
        state = self.optimizers[entry.optimizer_index].state[entry.param]
        state.clear()
        state.update(device_placeholders(entry, host) if placeholders is None else placeholders)
        self.device_states[entry.param] = state


def device_placeholders(entry: HostCacheEntry, host: HostCache) -> dict[str, Any]:
    """Zero-storage stand-ins for ``optimizer.state[param]`` (None where the entry has no moment)."""
    return {key: placeholder_like(entry.param, host[key]) if key in entry.keys else None for key in MOMENT_KEYS}


def placeholder_like(param: Any, tensor: torch.Tensor, wrap: Any = wrap_like_param) -> Any:
    """A zero-storage tensor like ``tensor`` for ``optimizer.state``, wrapped like ``param`` where on its device."""
    local = unwrap_dtensor(tensor)
    placeholder = torch.empty_strided(local.size(), local.stride(), dtype=local.dtype, device=local.device)
    placeholder.untyped_storage().resize_(0)
    if placeholder.device != unwrap_dtensor(param).device:
        return placeholder
    return wrap(placeholder, param)


def flat_layout(sizes: Sequence[int], page_size: int = PAGE_SIZE) -> tuple[list[int], int]:
    """Offsets of tensors of ``sizes`` bytes placed in order in one buffer, and its size:
    each on :data:`FLAT_ALIGN` bytes, or on a page when at least :data:`FLAT_PAGE_RUN` pages."""
    offsets, end = [], 0
    for size in sizes:
        align = page_size if size >= FLAT_PAGE_RUN * page_size else FLAT_ALIGN
        offsets.append(-(-end // align) * align)
        end = offsets[-1] + size
    return offsets, end


def flat_host_caches(
    entries: Sequence[HostCacheEntry], allocate: Callable[[int, Sequence[tuple[int, int]]], torch.Tensor]
) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """The caches of ``entries`` as views of one buffer ``allocate(nbytes, spans)``: the moments
    in update order, then every step in one vector. One exactly sized buffer, because torch's
    pinned allocator rounds each allocation up to a power of two (a 2.1 GB moment takes 4 GB)."""
    shapes = [(entry, key) for entry in entries for key in entry.keys]
    sizes = [entry.shape.numel() * entry.dtype.itemsize for entry, _ in shapes]
    sizes.append(len(entries) * STEP_DTYPE.itemsize)
    offsets, total = flat_layout(sizes)
    buffer = allocate(total, list(zip(offsets, sizes, strict=True)))
    cache: dict[torch.Tensor, dict[str, torch.Tensor]] = {entry.param: {} for entry in entries}
    for (entry, key), offset, size in zip(shapes, offsets, sizes, strict=False):
        cache[entry.param][key] = buffer[offset : offset + size].view(entry.dtype).view(entry.shape)
    steps = buffer[offsets[-1] : offsets[-1] + sizes[-1]].view(STEP_DTYPE)
    for index, entry in enumerate(entries):
        cache[entry.param][STEP_KEY] = steps[index]
    return cache


@dataclass(eq=False)
class SliceStates:
    """State tensors of one update call over a slice, per key one per parameter (None: no such moment);
    ``steps``: the vector the ``STEP_KEY`` tensors are elements of (one copy, one ``add_``), or None."""

    tensors: dict[str, list[Any]]
    steps: torch.Tensor | None = None


def steps_vector(steps: Sequence[Any]) -> torch.Tensor | None:
    """``steps`` as the vector whose consecutive elements they are (the flat caches' layout), else None."""
    scalars = all(isinstance(s, torch.Tensor) and s.dim() == 0 and s.dtype == STEP_DTYPE for s in steps)
    if not steps or not scalars:
        return None
    first = steps[0]
    storage = first.untyped_storage()
    base, offset = storage.data_ptr(), first.storage_offset()
    if (offset + len(steps)) * STEP_DTYPE.itemsize > storage.nbytes():
        return None
    for index, step in enumerate(steps):
        same_place = step.device == first.device and step.untyped_storage().data_ptr() == base
        if not same_place or step.storage_offset() != offset + index:
            return None
    return first.as_strided((len(steps),), (1,), offset)


def fqns_by_param(model: nn.Module) -> dict[torch.Tensor, tuple[str, ...]]:
    """Every parameter's checkpoint names, DCP's canonical (first registered) first: tied
    parameters are saved once and load from any alias."""
    names: dict[torch.Tensor, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        fqns = _get_fqns(model, name)
        if len(fqns) != 1:
            raise NotImplementedError(f"parameter {name!r} maps to several FQNs {sorted(fqns)} (a flattened FSDP1 "
                                      "parameter); the swap optimizer needs one parameter per FQN")
        names.setdefault(param, []).extend(fqns)
    return {param: tuple(dict.fromkeys(fqns)) for param, fqns in names.items()}


def param_fqns(fqns: Mapping[torch.Tensor, tuple[str, ...]], param: torch.Tensor,
               optimizer_index: int | None = None) -> tuple[str, ...]:
    """``param``'s names from :func:`fqns_by_param`; a clear error for a stranger."""
    names = fqns.get(param)
    if not names:
        where = "" if optimizer_index is None else f" of optimizer {optimizer_index}"
        raise ValueError(f"a parameter{where} (shape {tuple(param.shape)}) is not in its model part; "
                         "swap optimizer state is keyed by parameter FQN")
    return names
