"""In-process swap optimizer for torchtitan 0.2.x: Adam moments live in host memory.

:class:`SwapOptimizersContainer` keeps ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``
with amsgrad) plus a per-parameter ``step`` in a *host cache* (pinned where an accelerator
exists). ``optimizer.state`` only holds zero-storage placeholders. ``step()`` streams the
moments through the accelerator in ``swap_optimizer_times`` slices:

    load (H2D, load stream) -> fused Adam/AdamW (compute stream) -> offload (D2H, offload stream)

with events between the streams, so slice k+1 loads while slice k updates and slice k-1
offloads. On a CPU-only process the fused update runs directly on the host cache.

Importing this module wraps ``torchtitan.components.optimizer.build_optimizers``:
``optimizer_config.swap_optimizer = True`` builds a :class:`SwapOptimizersContainer`,
anything else goes to torchtitan's own function. ``torch.optim.Adam.step`` /
``AdamW.step`` are never patched: only the container's own optimizers step through the
swap pipeline (each gets a bound ``step``).

Checkpoints are a flat dict (``state.<fqn>.<key>``, ``param_groups.<fqn>.<hyperparameter>``)
read from the host cache; tied parameters are saved once under their canonical name and
load from any alias. See ``../shared/seed/`` for the behavioural spec.
"""

from __future__ import annotations

import copy
import functools
import logging
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn as nn
import torchtitan.components.optimizer as _tt_optimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim import Optimizer
from torch.optim.optimizer import _device_dtype_check_for_fused
from torchtitan.components.optimizer import OptimizersContainer

from swap_state.client._swap_kernels import fused_adam_update, plan_slices
from swap_state.client.device import DeviceBackend, get_device_backend

try:  # DCP's canonical FQNs (strips activation-checkpoint / compile / DDP prefixes)
    from torch.distributed.checkpoint.state_dict import _get_fqns
except ImportError:  # pragma: no cover - every torch this project supports has it
    _get_fqns = None

__all__ = [
    "DEFAULT_SWAP_TIMES",
    "MOMENT_KEYS",
    "STEP_DTYPE",
    "STEP_KEY",
    "DTensor",
    "HostCacheEntry",
    "SwapOptimizersContainer",
    "build_optimizers",
    "get_torch_device",
    "install_build_optimizers_wrapper",
    "unwrap_dtensor",
    "wrap_like_param",
    "wrap_like_param_without_device_move",
]

logger = logging.getLogger(__name__)

#: Adam state tensors shaped like the parameter, in host-cache order.
MOMENT_KEYS: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: Per-parameter step count, kept in the host cache next to the moments.
STEP_KEY = "step"
#: torch's fused Adam keeps ``step`` as a float32 scalar.
STEP_DTYPE = torch.float32
DEFAULT_SWAP_TIMES = 16

_SWAP_OPTIMIZER_CLASSES: dict[str, type[Optimizer]] = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}

_T = TypeVar("_T")
HostCache = dict[str, torch.Tensor | None]


def get_torch_device() -> DeviceBackend:
    """The process's device backend (``empty_cache``, ``current_device``, streams, ...)."""
    return get_device_backend()


def unwrap_dtensor(tensor: Any) -> Any:
    """The local tensor of a DTensor; anything else unchanged."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def wrap_like_param(local_tensor: torch.Tensor, like: Any) -> Any:
    """``local_tensor`` as a DTensor laid out like ``like`` (unchanged if ``like`` is not one)."""
    if isinstance(like, DTensor):
        return DTensor.from_local(
            local_tensor,
            device_mesh=like.device_mesh,
            placements=like.placements,
            shape=like.size(),
            stride=like.stride(),
            run_check=False,
        )
    return local_tensor


def wrap_like_param_without_device_move(local_tensor: torch.Tensor, like: Any) -> Any:
    """Like :func:`wrap_like_param`, but never copies: the DTensor shares ``local_tensor``.

    Built from a spec rather than ``DTensor.from_local`` so that a host-cache tensor stays
    on the host even when the mesh is an accelerator mesh.
    """
    if not isinstance(like, DTensor):
        return local_tensor
    spec = DTensorSpec(
        like.device_mesh,
        like.placements,
        tensor_meta=TensorMeta(shape=like.size(), stride=like.stride(), dtype=local_tensor.dtype),
    )
    return DTensor(local_tensor, spec, requires_grad=False)


@dataclass(frozen=True, eq=False)
class HostCacheEntry:
    """What :meth:`SwapOptimizersContainer._allocate_host_cache` allocates for one parameter.

    ``keys`` are the moment keys (``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` with
    amsgrad), each of ``shape`` (the local shard's shape) and ``dtype``; a 0-dim
    :data:`STEP_DTYPE` tensor under :data:`STEP_KEY` goes with them. ``fqn`` is the
    canonical checkpoint name.
    """

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


class _instance_or_class_method:
    """Method bound to the instance when looked up on one, to the class otherwise.

    The seed calls some helpers on the class (``SwapOptimizersContainer._state_value_for_state_dict(...)``)
    and expects the class-level maps; through an instance they must see its own maps.
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        self.__func__ = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        return types.MethodType(self.__func__, objtype if obj is None else obj)


@dataclass(eq=False)
class _StepItem:
    """A parameter with a gradient in this step, with its host cache."""

    param: torch.Tensor
    group: dict[str, Any]
    local_param: torch.Tensor
    local_grad: torch.Tensor
    host: HostCache


@dataclass(eq=False)
class _LoadedSlice:
    """Device buffers of one slice (one dict per item) and the event their loads end with."""

    items: list[_StepItem]
    buffers: list[dict[str, torch.Tensor]]
    ready: Any


@dataclass(eq=False)
class _ParamLoad:
    """A validated, prepared load of one parameter; applied by ``_commit_load``."""

    optimizer_index: int
    group_index: int
    optim: Optimizer
    group: dict[str, Any]
    param: torch.Tensor
    fqn: str
    keys: tuple[str, ...]
    sources: dict[str, torch.Tensor | None]  # None: never stepped in the checkpoint -> zeros
    step: float
    host: HostCache | None
    placeholders: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _GroupLoad:
    group: dict[str, Any]
    values: dict[str, Any]


@dataclass(eq=False)
class _LoadPlan:
    params: list[_ParamLoad] = field(default_factory=list)
    groups: list[_GroupLoad] = field(default_factory=list)


class _FlatIndex:
    """``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>`` of a flat state dict, by fqn."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self.sections: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "param_groups": {}}
        for flat_key, value in state_dict.items():
            section, _, rest = flat_key.partition(".")
            fqn, _, key = rest.rpartition(".")
            if section in self.sections and fqn and key:
                self.sections[section].setdefault(fqn, {})[key] = value

    def lookup(self, section: str, aliases: Sequence[str], key: str) -> tuple[str, Any] | None:
        """``(flat key, value)`` under the first alias that has ``key``, else None."""
        for fqn in aliases:
            entries = self.sections[section].get(fqn)
            if entries is not None and key in entries:
                return f"{section}.{fqn}.{key}", entries[key]
        return None

    def entries(self, section: str, aliases: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
        """``(alias, {key: value})`` of the first alias with entries in ``section``."""
        for fqn in aliases:
            entries = self.sections[section].get(fqn)
            if entries:
                return fqn, entries
        return None


def _moment_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    return MOMENT_KEYS if group.get("amsgrad", False) else MOMENT_KEYS[:2]


def _group_map(optim: Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    return {param: group for group in optim.param_groups for param in group["params"]}


def _has_data(tensor: torch.Tensor) -> bool:
    return tensor.numel() == 0 or tensor.untyped_storage().size() > 0


def _clone_value(value: Any) -> Any:
    """A checkpoint value detached from its source: tensors cloned to CPU, others deep-copied."""
    if isinstance(value, torch.Tensor):
        return unwrap_dtensor(value).detach().cpu().clone()
    return copy.deepcopy(value)


def _step_tensor(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=STEP_DTYPE)


class SwapOptimizersContainer(OptimizersContainer):
    """torchtitan ``OptimizersContainer`` whose Adam/AdamW moments live in host memory.

    ``SwapOptimizersContainer(model_parts, optimizer_cls, optimizer_kwargs, swap_optimizer_times)``
    builds one ``optimizer_cls`` per model part as torchtitan does; ``optimizer_cls`` must
    be ``torch.optim.Adam`` or ``AdamW`` (or a subclass). The update is always torch's fused
    kernel (bit-identical to ``fused=True``), whatever ``foreach``/``fused`` say.

    Keyword-only extras: ``param_groups(model_part) -> list[dict]`` to build param groups
    (default: one group of every trainable parameter), ``device_backend`` (default:
    :func:`get_torch_device`), ``pipeline`` (default: on iff the backend is an accelerator;
    ``True`` on CPU runs the load/offload pipeline with CPU "device" buffers).

    Call order, for subclasses (e.g. a container whose host cache is shared memory):

    ``__init__``
        1. one torch optimizer per model part; ``param_groups[i]["step"]`` is created;
        2. ``_allocate_host_cache(entries)`` once, every parameter, in update order;
        3. placeholders go into ``optimizer.state``; each optimizer's ``step`` is bound
           to the swap pipeline.
    ``step()`` (per container step; each optimizer in turn)
        1. gradients are checked (sparse, DTensor layout, dtype) before anything changes;
        2. every group's ``step`` += 1;
        3. per slice, accelerator: load(k+1) is enqueued, update(k) runs after load(k),
           then ``_before_host_write(params of k)``, then offload(k) is enqueued;
           CPU: ``_before_host_write(params of k)``, then update(k) in place;
        4. all offloads are waited for (host sync), then, once per container step,
           ``_after_step()``.
    ``state_dict()``
        reads the host cache (views, no copy; no hook).
    ``load_state_dict(sd)``
        validate everything -> ``_allocate_host_cache`` for parameters without a cache ->
        ``_before_host_write(all params)`` -> copy into the host cache (in place) ->
        ``empty_cache()`` once -> ``_after_load_state_dict()``.

    A subclass overrides ``_allocate_host_cache`` to place the cache (for example views of
    a registered shared-memory segment; the container only copies into these tensors,
    never replaces them), ``_before_host_write`` to guard bytes another reader still needs
    (it may block: back-pressure), ``_after_step`` to publish a finished step and
    ``_after_load_state_dict`` to publish a restore.
    """

    # The seed's tests build containers with __new__ and patch these; __init__ shadows
    # them with per-instance dicts, and every method goes through ``self.``.
    param_to_cpu_states_map: dict[torch.Tensor, HostCache] = {}  # noqa: RUF012
    param_to_device_states_map: dict[torch.Tensor, dict[str, Any]] = {}  # noqa: RUF012
    state_keys: tuple[str, ...] = MOMENT_KEYS

    swap_optimizer_times: int = DEFAULT_SWAP_TIMES
    _device_backend: DeviceBackend | None = None
    _pipeline: bool | None = None
    _swap_streams: tuple[Any, Any] | None = None
    _in_container_step: bool = False

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: dict[str, Any],
        swap_optimizer_times: int = DEFAULT_SWAP_TIMES,
        *,
        param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
        device_backend: DeviceBackend | None = None,
        pipeline: bool | None = None,
    ) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Adam)):
            raise NotImplementedError(
                f"Optimizer {getattr(optimizer_cls, '__name__', optimizer_cls)} not added."
            )
        if int(swap_optimizer_times) < 1:
            raise ValueError(f"swap_optimizer_times must be >= 1, got {swap_optimizer_times}")
        self.param_to_cpu_states_map = {}
        self.param_to_device_states_map = {}
        self.swap_optimizer_times = int(swap_optimizer_times)
        self._device_backend = device_backend or get_torch_device()
        self._pipeline = self._device_backend.is_accelerator if pipeline is None else bool(pipeline)
        if param_groups is None:
            super().__init__(model_parts, optimizer_cls, optimizer_kwargs)
        else:
            self._init_grouped(model_parts, optimizer_cls, optimizer_kwargs, param_groups)
        self._init_swap_state()

    def _init_grouped(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: dict[str, Any],
        param_groups: Callable[[nn.Module], list[dict[str, Any]]],
    ) -> None:
        """``OptimizersContainer.__init__`` with caller-built param groups."""
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for model in model_parts:
            groups = param_groups(model)
            self.optimizers.append(optimizer_cls(groups, **optimizer_kwargs))
            all_params.extend(param for group in groups for param in group["params"])
        self._validate_length(len(model_parts))
        self._post_init(all_params, optimizer_kwargs)

    def _init_swap_state(self) -> None:
        """Group steps, host caches, placeholders and bound steps for every optimizer."""
        entries: list[HostCacheEntry] = []
        for index, (model, optim) in enumerate(zip(self.model_parts, self.optimizers, strict=True)):
            optim.param_to_group_map = _group_map(optim)  # type: ignore[attr-defined]
            for group in optim.param_groups:
                group.setdefault(STEP_KEY, _step_tensor(0))
            pairs = [(gi, p) for gi, g in enumerate(optim.param_groups) for p in g["params"]]
            entries.extend(self._host_cache_entries(index, model, optim, pairs))
        seen: set[int] = set()
        for entry in entries:
            if id(entry.param) in seen:
                raise ValueError(f"parameter {entry.fqn!r} is in more than one optimizer or group")
            seen.add(id(entry.param))
        self._install_host_caches(entries)
        for optim in self.optimizers:
            optim.step = _bind_swap_step(self, optim)  # type: ignore[method-assign]
        logger.info(
            "swap optimizer: %d parameters, %.1f MiB of moments in host memory, %d slices, %s",
            len(entries),
            sum(e.nbytes for e in entries) / 2**20,
            self.swap_optimizer_times,
            "pipelined" if self._swap_pipeline_enabled() else "in place on CPU",
        )

    # -- hooks for subclasses ------------------------------------------------------------
    def _allocate_host_cache(
        self, entries: Sequence[HostCacheEntry]
    ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Allocate the host cache of ``entries`` (in update order); return ``{param: {key: tensor}}``.

        Each dict holds every key of ``entry.keys`` (CPU, ``entry.shape``, ``entry.dtype``,
        contiguous) and :data:`STEP_KEY` (0-dim :data:`STEP_DTYPE`), holding either zeros or
        restored state. Called once from ``__init__`` with every parameter, and again only
        for parameters without a cache (param groups added later, or a load into a
        container not built by ``__init__``). Default: zeroed tensors, pinned where an
        accelerator exists.
        """
        backend = self._backend
        cache: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for entry in entries:
            tensors = {key: backend.alloc_host(entry.shape, entry.dtype) for key in entry.keys}
            tensors[STEP_KEY] = backend.alloc_host((), STEP_DTYPE)
            cache[entry.param] = tensors
        return cache

    def _before_host_write(self, params: Sequence[torch.Tensor]) -> None:
        """Called before the host cache of ``params`` is overwritten. Default: nothing.

        In ``step()``: per slice, on CPU before the fused update of the slice, on an
        accelerator before the slice's offload is enqueued. In ``load_state_dict()``: once,
        with every parameter, after validation and before any byte changes. May block.
        """

    def _after_step(self) -> None:
        """Called once per container step, after every offload of the step is complete."""

    def _after_load_state_dict(self) -> None:
        """Called after ``load_state_dict()`` has written the host cache and emptied the cache."""

    # -- host cache ----------------------------------------------------------------------
    @property
    def device_backend(self) -> DeviceBackend:
        """The backend this container moves state with."""
        return self._backend

    @property
    def _backend(self) -> DeviceBackend:
        return self._device_backend or get_torch_device()

    def _swap_pipeline_enabled(self) -> bool:
        return self._backend.is_accelerator if self._pipeline is None else self._pipeline

    def _host_cache_entries(
        self,
        optimizer_index: int,
        model: nn.Module,
        optim: Optimizer,
        pairs: Iterable[tuple[int, torch.Tensor]],
    ) -> list[HostCacheEntry]:
        """Entries for ``(group_index, param)`` pairs of ``optim``, in the given order."""
        fqns = self._fqns_by_param(model)
        entries = []
        for group_index, param in pairs:
            fqn = self._param_fqns(fqns, param, optimizer_index)[0]
            local = unwrap_dtensor(param)
            if not local.is_contiguous():
                # The fused kernel walks memory linearly: a host cache laid out differently
                # from the parameter would pair the wrong elements.
                raise ValueError(
                    f"parameter {fqn!r} is not contiguous; the swap optimizer needs contiguous parameters"
                )
            group = optim.param_groups[group_index]
            entries.append(
                HostCacheEntry(
                    param, fqn, _moment_keys(group), local.shape, local.dtype, optimizer_index, group_index
                )
            )
        return entries

    def _checked_host_cache(self, entry: HostCacheEntry, tensors: Mapping[str, Any] | None) -> HostCache:
        """``tensors`` from ``_allocate_host_cache`` checked against ``entry``, in map format."""
        if tensors is None:
            raise ValueError(f"_allocate_host_cache returned no cache for {entry.fqn!r}")
        expected = {key: (entry.shape, entry.dtype) for key in entry.keys}
        expected[STEP_KEY] = (torch.Size(()), STEP_DTYPE)
        for key, (shape, dtype) in expected.items():
            tensor = tensors.get(key)
            if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
                raise ValueError(f"host cache of {entry.fqn!r} has no tensor under {key!r}")
            if tensor.device.type != "cpu" or tensor.shape != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"host cache {entry.fqn!r}.{key}: expected a CPU {dtype} tensor of shape {tuple(shape)}, "
                    f"got {tensor.device} {tensor.dtype} {tuple(tensor.shape)}"
                )
            if not tensor.is_contiguous() or not _has_data(tensor):
                raise ValueError(f"host cache {entry.fqn!r}.{key} must be contiguous and have storage")
        host: HostCache = {key: tensors[key] if key in entry.keys else None for key in MOMENT_KEYS}
        host[STEP_KEY] = tensors[STEP_KEY]
        return host

    def _install_host_caches(self, entries: Sequence[HostCacheEntry]) -> None:
        """Allocate caches for ``entries`` and install them with fresh placeholders."""
        if not entries:
            return
        allocated = self._allocate_host_cache(entries)
        checked = [(entry, self._checked_host_cache(entry, allocated.get(entry.param))) for entry in entries]
        for entry, host in checked:
            self.param_to_cpu_states_map[entry.param] = host
            state = self.optimizers[entry.optimizer_index].state[entry.param]
            state.clear()
            state.update(self._device_placeholders(entry.param, host))
            self.param_to_device_states_map[entry.param] = state

    def _device_placeholders(self, param: torch.Tensor, host: HostCache) -> dict[str, Any]:
        """Zero-storage stand-ins for ``optimizer.state[param]`` (None where no moment)."""
        return {
            key: None
            if host.get(key) is None
            else self._clone_loaded_state_for_device_placeholder(param, host[key])
            for key in MOMENT_KEYS
        }

    # -- step ----------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step every optimizer through the swap pipeline, then call ``_after_step()`` once."""
        self._in_container_step = True
        try:
            # Not super().step(): once any plain OptimizersContainer exists, torch has
            # wrapped that method with the step hooks, which would then run twice.
            for optimizer in self.optimizers:
                optimizer.step(*args, **kwargs)
        finally:
            self._in_container_step = False
        self._after_step()

    def _swap_step(self, optim: Optimizer, closure: Callable[[], _T] | None = None) -> _T | None:
        """``optim.step(closure)``: one optimizer's update through the host cache.

        Called through the bound ``optim.step`` (torch's step hooks and LR-scheduler
        tracking still apply). Outside ``container.step()`` it calls ``_after_step()``
        itself.
        """
        if torch.jit.is_scripting():
            raise RuntimeError("torch.jit.script is not supported by SwapOptimizersContainer")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            slices = self._collect_step_work(optim)
            for group in optim.param_groups:
                _advance_group_step(group)
            if self._swap_pipeline_enabled():
                self._pipelined_update(optim, slices)
            else:
                self._inplace_update(optim, slices)
        if not self._in_container_step:
            self._after_step()
        return loss

    def _slices_for(self, optim: Optimizer) -> list[list[torch.Tensor]]:
        """``optim``'s parameters in update order, cut into byte-balanced slices (cached)."""
        signature = tuple((id(group), tuple(map(id, group["params"]))) for group in optim.param_groups)
        cache: dict[int, tuple[Any, list[list[torch.Tensor]]]] = self.__dict__.setdefault("_slice_cache", {})
        cached = cache.get(id(optim))
        if cached is None or cached[0] != signature:
            params = [param for group in optim.param_groups for param in group["params"]]
            sizes = [unwrap_dtensor(p).numel() * p.element_size() for p in params]
            slices = [[params[i] for i in run] for run in plan_slices(sizes, self.swap_optimizer_times)]
            optim.param_to_group_map = _group_map(optim)  # type: ignore[attr-defined]
            cache[id(optim)] = cached = (signature, slices)
        return cached[1]

    def _collect_step_work(self, optim: Optimizer) -> list[list[_StepItem]]:
        """The parameters with gradients, per slice; validates them all before any change."""
        planned = self._slices_for(optim)  # also refreshes optim.param_to_group_map
        group_map: dict[torch.Tensor, dict[str, Any]] = optim.param_to_group_map  # type: ignore[attr-defined]
        slices: list[list[_StepItem]] = []
        for params in planned:
            items = []
            for param in params:
                if param.grad is None:
                    continue  # as torch: no gradient, no update, no step increment
                group = group_map[param]
                local_param, local_grad = _checked_param_and_grad(param, param.grad, group)
                host = self.param_to_cpu_states_map.get(param)
                items.append(_StepItem(param, group, local_param, local_grad, host or {}))
            if items:
                slices.append(items)
        self._complete_host_caches(optim, [item for items in slices for item in items])
        return slices

    def _complete_host_caches(self, optim: Optimizer, items: list[_StepItem]) -> None:
        """Allocate caches for parameters that have none; add a missing per-param step."""
        missing = [item for item in items if not _host_cache_ready(item.host, item.group)]
        if missing:
            index = next(i for i, o in enumerate(self.optimizers) if o is optim)
            group_index = {id(g): gi for gi, g in enumerate(optim.param_groups)}
            pairs = [(group_index[id(item.group)], item.param) for item in missing]
            self._install_host_caches(self._host_cache_entries(index, self.model_parts[index], optim, pairs))
            for item in missing:
                item.host = self.param_to_cpu_states_map[item.param]
        for item in items:
            if item.host.get(STEP_KEY) is None:
                # A cache built without a per-param step (the seed's layout): every
                # parameter has taken the group's steps so far.
                item.host[STEP_KEY] = _step_tensor(_number(item.group.get(STEP_KEY, 0)))

    def _inplace_update(self, optim: Optimizer, slices: list[list[_StepItem]]) -> None:
        """CPU: the fused kernel updates the host cache directly, slice by slice."""
        for items in slices:
            self._before_host_write([item.param for item in items])
            self._fused_update(optim, items, [item.host for item in items])

    def _pipelined_update(self, optim: Optimizer, slices: list[list[_StepItem]]) -> None:
        """Accelerator: load(k+1) || update(k) || offload(k-1), then wait for all offloads.

        At most three slices hold device buffers at a time (one loading, one updating,
        one offloading); each buffer is freed once its offload is done.
        """
        if not slices:
            return
        backend = self._backend
        load_stream, offload_stream = self._streams()
        compute = backend.current_stream()
        upcoming = self._load_slice(slices[0], load_stream)
        for index in range(len(slices)):
            current = upcoming
            if index + 1 < len(slices):
                upcoming = self._load_slice(slices[index + 1], load_stream)
            compute.wait_event(current.ready)
            self._fused_update(optim, current.items, current.buffers)
            for buffers in current.buffers:
                for buffer in buffers.values():
                    backend.record_stream(buffer, compute)
            updated = backend.event()
            updated.record(compute)
            self._offload_slice(current, updated, offload_stream)
        offload_stream.synchronize()

    def _streams(self) -> tuple[Any, Any]:
        """``(load, offload)`` side streams, created on first use."""
        if self._swap_streams is None:
            self._swap_streams = (self._backend.stream(), self._backend.stream())
        return self._swap_streams

    def _load_slice(self, items: list[_StepItem], stream: Any) -> _LoadedSlice:
        """Enqueue H2D copies of ``items``' host cache on ``stream``; record ``ready`` after."""
        backend = self._backend
        buffers = []
        # Allocated while ``stream`` is current, so the caching allocator ties the blocks
        # to the load stream; the compute and offload streams are recorded later.
        with backend.use_stream(stream):
            for item in items:
                device_state = {}
                for key in _moment_keys(item.group):
                    buffer = torch.empty_like(item.local_param, memory_format=torch.contiguous_format)
                    buffer.copy_(item.host[key], non_blocking=True)
                    device_state[key] = buffer
                step = torch.empty((), dtype=STEP_DTYPE, device=item.local_param.device)
                step.copy_(item.host[STEP_KEY], non_blocking=True)
                device_state[STEP_KEY] = step
                buffers.append(device_state)
            ready = backend.event()
            ready.record(stream)
        return _LoadedSlice(items, buffers, ready)

    def _offload_slice(self, loaded: _LoadedSlice, updated: Any, stream: Any) -> None:
        """Enqueue D2H copies of ``loaded`` after ``updated``; drop the device buffers."""
        self._before_host_write([item.param for item in loaded.items])
        backend = self._backend
        with backend.use_stream(stream):
            stream.wait_event(updated)
            for item, buffers in zip(loaded.items, loaded.buffers, strict=True):
                for key, buffer in buffers.items():
                    item.host[key].copy_(buffer, non_blocking=True)  # type: ignore[union-attr]
                    backend.record_stream(buffer, stream)
        loaded.buffers.clear()

    def _fused_update(
        self, optim: Optimizer, items: list[_StepItem], states: Sequence[Mapping[str, Any]]
    ) -> None:
        """One fused kernel call per param group over ``items`` with state tensors ``states``."""
        by_group: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            by_group.setdefault(id(item.group), []).append(index)
        for indices in by_group.values():
            group = items[indices[0]].group
            fused_adam_update(
                [items[i].local_param for i in indices],
                [items[i].local_grad for i in indices],
                [states[i]["exp_avg"] for i in indices],
                [states[i]["exp_avg_sq"] for i in indices],
                [states[i]["max_exp_avg_sq"] for i in indices] if group["amsgrad"] else [],
                [states[i][STEP_KEY] for i in indices],
                group=group,
                grad_scale=getattr(optim, "grad_scale", None),
                found_inf=getattr(optim, "found_inf", None),
            )

    # -- state_dict ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Flat ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>`` dict from the host cache.

        Moments are views of the host cache (DTensor-wrapped like their parameter, never
        copied to a device); ``step`` values and group values are copies. Tied parameters
        appear once, under their canonical name. torchtitan's own conversion is not used.
        """
        flat: dict[str, Any] = {}
        for model, optim in zip(self.model_parts, self.optimizers, strict=True):
            fqns = self._fqns_by_param(model)
            for group in optim.param_groups:
                for param in group["params"]:
                    fqn = self._param_fqns(fqns, param)[0]
                    state = optim.state.get(param, {})
                    for key in MOMENT_KEYS:
                        value = self._state_value_for_state_dict(param, state, key)
                        if value is not None:
                            flat[f"state.{fqn}.{key}"] = value
                    flat[f"state.{fqn}.{STEP_KEY}"] = self._state_step_for_state_dict(group, param)
                    for key, value in group.items():
                        if key != "params":
                            flat[f"param_groups.{fqn}.{key}"] = _clone_value(value)
        return flat

    @_instance_or_class_method
    def _state_value_for_state_dict(self, param: Any, state: Mapping[str, Any], key: str) -> Any:
        """``key``'s checkpoint value for ``param``: its host cache, else its device state."""
        host = self.param_to_cpu_states_map.get(param)
        value = host.get(key) if host is not None else None
        if value is None:
            value = state.get(key)
        if value is None:
            return None
        return self._tensor_for_state_dict(value, param)

    @_instance_or_class_method
    def _state_step_for_state_dict(self, group: Mapping[str, Any], param: Any) -> torch.Tensor:
        """The per-param step when known, else the group's step, as a new CPU tensor."""
        host = self.param_to_cpu_states_map.get(param) or {}
        step = host.get(STEP_KEY)
        if step is None:
            step = group.get(STEP_KEY, 0)
        if isinstance(step, torch.Tensor):
            return unwrap_dtensor(step).detach().cpu().clone()
        return _step_tensor(step)

    @staticmethod
    def _tensor_for_state_dict(tensor: Any, like_param: Any = None) -> Any:
        """A CPU view of ``tensor`` for a checkpoint, DTensor-wrapped like ``like_param``.

        A non-empty tensor without storage is a swapped-out placeholder: an error.
        """
        local = unwrap_dtensor(tensor)
        if local.numel() != 0 and local.untyped_storage().size() == 0:
            raise RuntimeError(
                "cannot checkpoint a swapped-out optimizer state without CPU cache: "
                f"tensor of shape {tuple(local.shape)} has no storage"
            )
        value = local.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        if isinstance(like_param, DTensor):
            return wrap_like_param_without_device_move(value, like_param)
        return value

    @staticmethod
    def _fqns_by_param(model: nn.Module) -> dict[torch.Tensor, tuple[str, ...]]:
        """Every parameter's checkpoint names, canonical (first registered) first."""
        names: dict[torch.Tensor, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(param, []).extend(_canonical_fqns(model, name))
        return {param: tuple(dict.fromkeys(fqns)) for param, fqns in names.items()}

    @staticmethod
    def _param_fqns(
        fqns: Mapping[torch.Tensor, tuple[str, ...]], param: torch.Tensor, optimizer_index: int | None = None
    ) -> tuple[str, ...]:
        names = fqns.get(param)
        if not names:
            where = "" if optimizer_index is None else f" of optimizer {optimizer_index}"
            raise ValueError(
                f"a parameter{where} (shape {tuple(param.shape)}) is not in its model part; "
                "swap optimizer state is keyed by parameter FQN"
            )
        return names

    @staticmethod
    def _move_step_to_device(step: Any) -> Any:
        """``step`` on the current device if it is a CPU tensor, else unchanged.

        The seed's helper for a device-resident group step. This container keeps group and
        per-parameter steps on the host; the pipeline copies per-parameter steps to the
        device with their slice.
        """
        if isinstance(step, torch.Tensor) and step.device.type == "cpu":
            return step.to(get_torch_device().current_device())
        return step

    @staticmethod
    def _clone_loaded_state_for_device_placeholder(param: Any, tensor: torch.Tensor) -> Any:
        """A zero-storage tensor shaped like ``tensor`` (on its device) for ``optimizer.state``.

        Wrapped like ``param`` only when ``param``'s local tensor is on the same device.
        """
        local = unwrap_dtensor(tensor)
        placeholder = torch.empty_strided(
            local.size(), local.stride(), dtype=local.dtype, device=local.device
        )
        placeholder.untyped_storage().resize_(0)
        if placeholder.device != unwrap_dtensor(param).device:
            return placeholder
        return wrap_like_param(placeholder, param)

    # -- load_state_dict -----------------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a flat state dict (from :meth:`state_dict`, any alias of tied parameters).

        Everything is validated and prepared first; a bad key raises ``KeyError`` /
        ``ValueError`` / ``TypeError`` naming it and leaves the container untouched. The
        checkpoint's tensors are only read. A parameter with param-group entries but no
        state was never stepped in the checkpoint (torch creates state lazily): it starts
        from zeros and step 0.
        """
        plan = self._plan_load(state_dict)
        self._before_host_write([load.param for load in plan.params])
        self._commit_load(plan)
        get_torch_device().empty_cache()
        self._after_load_state_dict()

    def _plan_load(self, state_dict: Mapping[str, Any]) -> _LoadPlan:
        """Validate ``state_dict`` against every group and parameter; prepare the load."""
        index = _FlatIndex(state_dict)
        plan = _LoadPlan()
        for optimizer_index, (model, optim) in enumerate(zip(self.model_parts, self.optimizers, strict=True)):
            fqns = self._fqns_by_param(model)
            for group_index, group in enumerate(optim.param_groups):
                group_load = _plan_group_load(index, optim, group, fqns)
                loads = [
                    self._plan_param_load(index, optimizer_index, group_index, optim, group_load, param, fqns)
                    for param in group["params"]
                ]
                if STEP_KEY not in group_load.values and STEP_KEY in group and loads:
                    group_load.values[STEP_KEY] = _step_tensor(max(load.step for load in loads))
                plan.groups.append(group_load)
                plan.params.extend(loads)
        self._prepare_load(plan)
        return plan

    def _plan_param_load(
        self,
        index: _FlatIndex,
        optimizer_index: int,
        group_index: int,
        optim: Optimizer,
        group_load: _GroupLoad,
        param: torch.Tensor,
        fqns: Mapping[torch.Tensor, tuple[str, ...]],
    ) -> _ParamLoad:
        aliases = self._param_fqns(fqns, param, optimizer_index)
        fqn = aliases[0]
        keys = _moment_keys(group_load.group)
        local_param = unwrap_dtensor(param)
        _check_amsgrad(index.lookup("param_groups", aliases, "amsgrad"), group_load.group)
        hits = {key: index.lookup("state", aliases, key) for key in (*keys, STEP_KEY)}
        sources: dict[str, torch.Tensor | None] = {}
        if not any(hits.values()):
            if index.entries("param_groups", aliases) is None:
                raise KeyError(
                    f"optimizer state dict has no entries for parameter {fqn!r}: "
                    f"no 'state.{fqn}.exp_avg' nor 'param_groups.{fqn}.*' (aliases tried: {list(aliases)})"
                )
            sources = dict.fromkeys(keys)
            step = 0.0
        else:
            for key in keys:
                hit = hits[key]
                if hit is None:
                    raise KeyError(
                        f"optimizer state dict has no 'state.{fqn}.{key}' (aliases tried: {list(aliases)})"
                    )
                sources[key] = _checked_state_tensor(hit[0], hit[1], local_param)
            step = _checked_step(hits[STEP_KEY], group_load, fqn)
        host = self.param_to_cpu_states_map.get(param)
        ready = host is not None and _host_cache_ready(host, group_load.group, local_param)
        return _ParamLoad(
            optimizer_index,
            group_index,
            optim,
            group_load.group,
            param,
            fqn,
            keys,
            sources,
            step,
            host if ready else None,
        )

    def _prepare_load(self, plan: _LoadPlan) -> None:
        """Allocate missing host caches and build placeholders; nothing live changes."""
        missing = [load for load in plan.params if load.host is None]
        if missing:
            entries = [
                HostCacheEntry(
                    load.param,
                    load.fqn,
                    load.keys,
                    unwrap_dtensor(load.param).shape,
                    unwrap_dtensor(load.param).dtype,
                    load.optimizer_index,
                    load.group_index,
                )
                for load in missing
            ]
            allocated = self._allocate_host_cache(entries)
            for load, entry in zip(missing, entries, strict=True):
                load.host = self._checked_host_cache(entry, allocated.get(entry.param))
        for load in plan.params:
            assert load.host is not None
            load.placeholders = {
                key: self._clone_loaded_state_for_device_placeholder(load.param, load.host[key])
                if key in load.keys
                else None
                for key in MOMENT_KEYS
            }

    def _commit_load(self, plan: _LoadPlan) -> None:
        """Apply a prepared plan. On an error, dict-level state is restored (bytes already
        copied into the host cache are not: validation leaves nothing expected to fail)."""
        saved = self._rollback_point()
        try:
            for load in plan.params:
                self._commit_param_load(load)
            for group_load in plan.groups:
                group_load.group.update(group_load.values)
            for optim in self.optimizers:
                optim.param_to_group_map = _group_map(optim)  # type: ignore[attr-defined]
        except BaseException:
            saved()
            raise

    def _commit_param_load(self, load: _ParamLoad) -> None:
        """Copy one parameter's state into its host cache and install its placeholders."""
        host = load.host
        assert host is not None
        for key in load.keys:
            source = load.sources[key]
            target = host[key]
            assert target is not None
            if source is None:
                target.zero_()
            else:
                target.copy_(source)
        if host.get(STEP_KEY) is None:
            host[STEP_KEY] = _step_tensor(0)
        host[STEP_KEY].fill_(load.step)  # type: ignore[union-attr]
        for key in MOMENT_KEYS:
            host.setdefault(key, None)
        self.param_to_cpu_states_map[load.param] = host
        state = load.optim.state[load.param]
        state.clear()
        state.update(load.placeholders)
        self.param_to_device_states_map[load.param] = state

    def _rollback_point(self) -> Callable[[], None]:
        """Snapshot every dict ``_commit_load`` mutates; the returned callable restores them."""
        groups = [(g, dict(g)) for optim in self.optimizers for g in optim.param_groups]
        states = [(optim, dict(optim.state)) for optim in self.optimizers]
        param_states = [(s, dict(s)) for optim in self.optimizers for s in optim.state.values()]
        hosts = [(h, dict(h)) for h in self.param_to_cpu_states_map.values() if h is not None]
        cpu_map = dict(self.param_to_cpu_states_map)
        device_map = dict(self.param_to_device_states_map)
        group_maps = [(optim, getattr(optim, "param_to_group_map", None)) for optim in self.optimizers]

        def restore() -> None:
            for target, saved in [*groups, *param_states, *hosts]:
                target.clear()
                target.update(saved)
            for optim, saved_state in states:
                optim.state.clear()
                optim.state.update(saved_state)
            for live, saved_map in (
                (self.param_to_cpu_states_map, cpu_map),
                (self.param_to_device_states_map, device_map),
            ):
                live.clear()
                live.update(saved_map)
            for optim, group_map in group_maps:
                optim.param_to_group_map = group_map  # type: ignore[attr-defined]

        return restore


# -- module helpers --------------------------------------------------------------------------
def _canonical_fqns(model: nn.Module, name: str) -> list[str]:
    if _get_fqns is None:  # pragma: no cover
        return [name]
    fqns = _get_fqns(model, name)
    if len(fqns) != 1:
        raise NotImplementedError(
            f"parameter {name!r} maps to several FQNs {sorted(fqns)} (a flattened FSDP1 parameter); "
            "the swap optimizer needs one parameter per FQN"
        )
    return list(fqns)


def _number(value: Any) -> float:
    return float(unwrap_dtensor(value).item()) if isinstance(value, torch.Tensor) else float(value)


def _advance_group_step(group: dict[str, Any]) -> None:
    """The group's step counts container steps (the seed keeps it; checkpoints carry it)."""
    step = group.get(STEP_KEY)
    if isinstance(step, torch.Tensor):
        step += 1
    else:
        group[STEP_KEY] = _step_tensor(_number(step or 0) + 1)


def _host_cache_ready(
    host: Mapping[str, Any] | None, group: Mapping[str, Any], local_param: Any = None
) -> bool:
    """Whether ``host`` holds every moment ``group`` needs, with data (and the right layout)."""
    if not host:
        return False
    for key in _moment_keys(group):
        tensor = host.get(key)
        if not isinstance(tensor, torch.Tensor) or not _has_data(tensor):
            return False
        if local_param is not None and (
            tensor.shape != local_param.shape or tensor.dtype != local_param.dtype
        ):
            return False
    return True


def _checked_param_and_grad(
    param: torch.Tensor, grad: torch.Tensor, group: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    if grad.is_sparse:
        raise RuntimeError(
            "SwapOptimizersContainer does not support sparse gradients, please consider SparseAdam instead"
        )
    if group.get("differentiable", False):
        raise RuntimeError("SwapOptimizersContainer does not support differentiable=True")
    param_layout = getattr(param, "placements", None) if isinstance(param, DTensor) else None
    grad_layout = getattr(grad, "placements", None) if isinstance(grad, DTensor) else None
    if param_layout != grad_layout:
        raise RuntimeError(
            "SwapOptimizersContainer updates local shards: the gradient must have the parameter's "
            f"placements ({param_layout}), got {grad_layout if grad_layout else 'a plain tensor'}"
        )
    local_param, local_grad = unwrap_dtensor(param), unwrap_dtensor(grad)
    _device_dtype_check_for_fused(local_param)
    return local_param, local_grad


def _plan_group_load(
    index: _FlatIndex, optim: Optimizer, group: dict[str, Any], fqns: Mapping[torch.Tensor, tuple[str, ...]]
) -> _GroupLoad:
    """The checkpoint's hyperparameters for ``group``, from the first of its parameters found.

    Other parameters' group entries are not compared (a checkpoint may group differently),
    except ``amsgrad``, which every parameter's load checks.
    """
    for param in group["params"]:
        found = index.entries("param_groups", fqns.get(param, ()))
        if found is not None:
            break
    else:
        return _GroupLoad(group, {})
    _, entries = found
    values = {key: _clone_value(value) for key, value in entries.items() if key != "params"}
    if isinstance(optim, torch.optim.AdamW) and "decoupled_weight_decay" in values:
        values["decoupled_weight_decay"] = True  # as AdamW.__setstate__
    return _GroupLoad(group, values)


def _check_amsgrad(hit: tuple[str, Any] | None, group: Mapping[str, Any]) -> None:
    """The host cache layout is fixed at construction: a checkpoint cannot switch amsgrad."""
    if hit is not None and bool(hit[1]) != bool(group.get("amsgrad", False)):
        raise ValueError(
            f"optimizer state dict key {hit[0]!r} is {hit[1]} but this container was built with "
            f"amsgrad={group.get('amsgrad', False)} (the host cache layout is fixed)"
        )


def _checked_state_tensor(flat_key: str, value: Any, local_param: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"optimizer state dict key {flat_key!r}: expected a tensor, got {type(value).__name__}"
        )
    local = unwrap_dtensor(value)
    if local.is_meta or not _has_data(local):
        raise ValueError(f"optimizer state dict key {flat_key!r}: the tensor has no data")
    if local.shape != local_param.shape:
        raise ValueError(
            f"optimizer state dict key {flat_key!r}: shape {tuple(local.shape)} does not match "
            f"the parameter's local shape {tuple(local_param.shape)}"
        )
    if local.dtype != local_param.dtype:
        raise ValueError(
            f"optimizer state dict key {flat_key!r}: dtype {local.dtype} does not match "
            f"the parameter's {local_param.dtype}"
        )
    return local


def _checked_step(hit: tuple[str, Any] | None, group_load: _GroupLoad, fqn: str) -> float:
    if hit is None:
        if STEP_KEY not in group_load.values:
            raise KeyError(f"optimizer state dict has no 'state.{fqn}.step' and no param group step")
        hit = (f"param_groups.{fqn}.step", group_load.values[STEP_KEY])
    flat_key, value = hit
    try:
        return _number(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"optimizer state dict key {flat_key!r}: expected a number or one-element tensor"
        ) from exc


def _bind_swap_step(container: SwapOptimizersContainer, optim: Optimizer) -> Callable[..., Any]:
    """``optim.step`` bound to the swap pipeline, with torch's step hooks around it.

    A method (``__func__`` + ``__self__``) so that LR schedulers can wrap it; the
    container is held weakly so that the optimizer does not keep it alive.
    """
    owner_ref = weakref.ref(container)

    def swap_step(optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        owner = owner_ref()
        if owner is None:
            raise RuntimeError("the SwapOptimizersContainer of this optimizer no longer exists")
        return owner._swap_step(optimizer, closure)

    swap_step.__qualname__ = f"{type(optim).__name__}.swap_step"
    return types.MethodType(Optimizer.profile_hook_step(swap_step), optim)


# -- torchtitan build_optimizers -----------------------------------------------------------
_WRAPPED_ORIGINAL_ATTR = "__swap_state_original__"


def build_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: Any,
    parallel_dims: Any,
    ft_manager: Any = None,
) -> OptimizersContainer:
    """torchtitan's ``build_optimizers`` plus ``optimizer_config.swap_optimizer``.

    Without ``swap_optimizer`` (or with it False) this is torchtitan's function. With it:
    ``name`` must be ``Adam`` or ``AdamW``; ``swap_optimizer_times`` (default 16) sets the
    slice count; ``swap_optimizer_backend = "remote"`` builds a
    :class:`~swap_state.client.remote_container.RemoteSwapOptimizersContainer` (settings in
    :mod:`swap_state.client.torchtitan_config`); optimizers-in-backward and TorchFT are not
    supported.
    """
    if not getattr(optimizer_config, "swap_optimizer", False):
        return _original_build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    name = optimizer_config.name
    optimizer_cls = _SWAP_OPTIMIZER_CLASSES.get(name)
    if optimizer_cls is None:
        raise NotImplementedError(f"Optimizer {name} not added.")
    if getattr(optimizer_config, "early_step_in_backward", False):
        raise NotImplementedError("swap_optimizer does not support early_step_in_backward")
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise NotImplementedError("swap_optimizer does not support TorchFT")
    implementation = getattr(optimizer_config, "implementation", "fused")
    optimizer_kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": implementation == "fused",
        "foreach": implementation == "foreach",
    }
    swap_times = int(getattr(optimizer_config, "swap_optimizer_times", DEFAULT_SWAP_TIMES))
    backend = getattr(optimizer_config, "swap_optimizer_backend", "local")
    if backend == "remote":
        from swap_state.client.torchtitan_config import build_remote_container

        return build_remote_container(model_parts, optimizer_cls, optimizer_kwargs, swap_times, optimizer_config)
    if backend != "local":
        raise ValueError(f"optimizer.swap_optimizer_backend must be 'local' or 'remote', got {backend!r}")
    # Looked up at call time, so that a patched module attribute is what gets built.
    return SwapOptimizersContainer(model_parts, optimizer_cls, optimizer_kwargs, swap_times)


_original_build_optimizers: Callable[..., OptimizersContainer] = getattr(
    _tt_optimizer.build_optimizers, _WRAPPED_ORIGINAL_ATTR, _tt_optimizer.build_optimizers
)
setattr(build_optimizers, _WRAPPED_ORIGINAL_ATTR, _original_build_optimizers)


def install_build_optimizers_wrapper() -> None:
    """Make ``torchtitan.components.optimizer.build_optimizers`` this module's wrapper.

    Idempotent: a wrapper already installed (also by an earlier import of this module) is
    replaced, never wrapped again. Import this module before ``torchtitan.models``: its
    TrainSpecs keep the function they saw at import.
    """
    _tt_optimizer.build_optimizers = build_optimizers


install_build_optimizers_wrapper()
