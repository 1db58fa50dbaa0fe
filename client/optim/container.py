"""``SwapOptimizersContainer``: torchtitan's ``OptimizersContainer`` with Adam moments in host memory.

The container holds one part per job (host caches, step pipeline, state loader, load
template); each reads the container's public state and calls its hooks, nothing else.
Importing it patches nothing in torchtitan (:mod:`swap_state.client.swap_optimizer` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import types
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from swap_state.client import device as device_layer  # an attribute: the seed's tests patch it
from swap_state.client.optim.kernels import pin_default_implementation
from swap_state.client.device import DeviceBackend
from swap_state.client.optim import flat_state_dict as _flat
from swap_state.client.optim.checkpoint_template import match_template
from swap_state.client.optim.host_cache import (
    STEP_DTYPE, STEP_KEY, HostCache, HostCacheEntry, HostCaches, flat_host_caches, fqns_by_param, group_map,
    placeholder_like, step_tensor)
from swap_state.client.optim.state_loading import StateLoader
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES, StepPipeline

__all__ = ["SwapOptimizersContainer", "UnswappedOptimizers", "bind_swap_step"]

# The facade's name: what users configure logging for.
logger = logging.getLogger("swap_state.client.swap_optimizer")


class _instance_or_class_method:
    """Method bound to the instance when looked up on one, to the class otherwise (the seed
    calls some helpers on the class and expects the class-level maps)."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.__func__ = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        return types.MethodType(self.__func__, objtype if obj is None else obj)


@dataclasses.dataclass(eq=False)
class UnswappedOptimizers:
    """The optimizers of parameters swap-state does not swap (torchtitan 0.3 lets param groups
    use other optimizers than Adam and AdamW: ``DistMuon``), with their own step and state.

    Their state stays where their own code keeps it; the container steps them after its own,
    iterates them for LR schedulers and checkpoints them in its flat FQN-keyed dict. Nothing of
    theirs is in snapshots, so whole-state snapshot checkpoints refuse them (the adapter checks).
    ``flat_state_dict(optimizer)`` and ``load_flat_state_dict(optimizer, flat)`` convert their
    state to and from the flat dict (torchtitan's ``get_flat_optim_state_dict`` /
    ``load_flat_optim_state_dict``)."""

    optimizers: list[Optimizer] = dataclasses.field(default_factory=list)
    flat_state_dict: Callable[[Optimizer], dict[str, Any]] | None = None
    load_flat_state_dict: Callable[[Optimizer, Mapping[str, Any]], None] | None = None

    @property
    def params(self) -> list[Any]:
        return [param for optimizer in self.optimizers for group in optimizer.param_groups for param in group["params"]]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for optimizer in self.optimizers:
            flat.update(self.flat_state_dict(optimizer))
        return flat

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for optimizer in self.optimizers:
            self.load_flat_state_dict(optimizer, state_dict)


class SwapOptimizersContainer(OptimizersContainer):
    """torchtitan ``OptimizersContainer`` whose Adam/AdamW moments live in host memory.

    One ``optimizer_cls`` (Adam or AdamW) per model part, as torchtitan builds them. Extras:
    ``pipeline`` (None: on iff an accelerator), ``moment_dtype`` (``torch.bfloat16``: torchtitan's
    ``fused_opt_states_bf16``), ``unswapped`` (other optimizers: :class:`UnswappedOptimizers`).

    Call order, for subclasses (e.g. a host cache in shared memory): ``__init__`` calls
    ``_allocate_host_cache(entries)`` once, in update order; ``step()`` checks gradients first,
    calls ``_before_host_write(params)`` per slice before its host bytes change (it may block) and
    ``_after_step()`` once every offload is complete; ``load_state_dict`` validates, then
    ``_allocate_host_cache`` for parameters without one -> ``_before_host_write(all params)`` ->
    copy in place (never replacing the cache's tensors) -> ``_after_load_state_dict()``.
    """

    # The seed's tests build containers with __new__ and patch these; __init__ shadows them.
    param_to_cpu_states_map: dict[torch.Tensor, HostCache] = {}  # noqa: RUF012
    param_to_device_states_map: dict[torch.Tensor, dict[str, Any]] = {}  # noqa: RUF012
    swap_optimizer_times: int = DEFAULT_SWAP_TIMES
    moment_dtype: torch.dtype | None = None
    unswapped: UnswappedOptimizers = UnswappedOptimizers()
    _device_backend: DeviceBackend | None = None
    _pipeline: bool | None = None
    _in_container_step: bool = False
    _loading_keys: frozenset[str] | None = None  # the optimizer keys of a checkpoint being loaded

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type[Optimizer], optimizer_kwargs: dict[str, Any],
                 swap_optimizer_times: int = DEFAULT_SWAP_TIMES, *,
                 param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
                 device_backend: DeviceBackend | None = None, pipeline: bool | None = None,
                 moment_dtype: torch.dtype | None = None, unswapped: UnswappedOptimizers | None = None) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Adam)):
            name = getattr(optimizer_cls, "__name__", optimizer_cls)
            raise NotImplementedError(f"Optimizer {name} not added.")
        if int(swap_optimizer_times) < 1:
            raise ValueError(f"swap_optimizer_times must be >= 1, got {swap_optimizer_times}")
        self.param_to_cpu_states_map = {}
        self.param_to_device_states_map = {}
        self.swap_optimizer_times = int(swap_optimizer_times)
        if moment_dtype is not None and moment_dtype not in (torch.float32, torch.bfloat16):
            allowed = "torch.float32 or torch.bfloat16 (or None: the parameter's)"
            raise ValueError(f"moment_dtype must be {allowed}, got {moment_dtype}")
        self.moment_dtype = moment_dtype
        self.unswapped = unswapped or UnswappedOptimizers()
        self._device_backend = device_backend or device_layer.get_device_backend()
        self._pipeline = self._device_backend.is_accelerator if pipeline is None else bool(pipeline)
        # torchtitan's OptimizersContainer.__init__, written here: its signature differs between 0.2 and 0.3.
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for model in model_parts:
            groups = (param_groups or _trainable_group)(model)
            self.optimizers.append(optimizer_cls(groups, **optimizer_kwargs))
            all_params.extend(param for group in groups for param in group["params"])
        all_params.extend(self.unswapped.params)
        # The container's own step hooks (LR schedulers, torchtitan's MoE load balancing).
        Optimizer.__init__(self, all_params, optimizer_kwargs)
        self._init_swap_state()

    def _init_swap_state(self) -> None:
        """Group steps, host caches, placeholders and bound steps for every optimizer."""
        entries: list[HostCacheEntry] = []
        for index, (model, optim) in enumerate(zip(self.model_parts, self.optimizers, strict=True)):
            optim.param_to_group_map = group_map(optim)  # type: ignore[attr-defined]
            for group in optim.param_groups:
                group.setdefault(STEP_KEY, step_tensor(0))
                pin_default_implementation(group)
            pairs = [(gi, p) for gi, g in enumerate(optim.param_groups) for p in g["params"]]
            entries.extend(self._host_caches.entries(index, model, optim, pairs))
        seen: set[int] = set()
        for entry in entries:
            if id(entry.param) in seen:
                raise ValueError(f"parameter {entry.fqn!r} is in more than one optimizer or group")
            seen.add(id(entry.param))
        self._host_caches.install(entries)
        for optim in self.optimizers:
            optim.step = bind_swap_step(self, optim)  # type: ignore[method-assign]
        mode = "pipelined" if self._steps.enabled() else "in place on CPU"
        logger.info("swap optimizer: %d parameters, %.1f MiB of moments in host memory, %d slices, %s",
                    len(entries), sum(e.nbytes for e in entries) / 2**20, self.swap_optimizer_times, mode)

    # -- the parts -----------------------------------------------------------------------
    @functools.cached_property
    def _host_caches(self) -> HostCaches:
        return HostCaches(self)

    @functools.cached_property
    def _steps(self) -> StepPipeline:
        return StepPipeline(self, self._host_caches, pipeline=self._pipeline)

    @functools.cached_property
    def _loader(self) -> StateLoader:
        return StateLoader(self, self._host_caches)

    @property
    def device_backend(self) -> DeviceBackend:
        """The backend this container moves state with (a container built with __new__, as the
        seed's tests do, has none of its own)."""
        return self._device_backend or device_layer.get_device_backend()

    # -- step ----------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step every optimizer through the swap pipeline, then call ``_after_step()`` once."""
        self._in_container_step = True
        try:
            # Not super().step(): torch may have wrapped it with the step hooks (run twice).
            for optimizer in self.optimizers:
                optimizer.step(*args, **kwargs)
            self.unswapped.step()
        finally:
            self._in_container_step = False
        self._after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
        self.unswapped.zero_grad(set_to_none)

    def __iter__(self) -> Iterator[Optimizer]:
        """Every optimizer, the unswapped ones last (torchtitan's LR schedulers iterate)."""
        return itertools.chain(self.optimizers, self.unswapped.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers) + len(self.unswapped.optimizers)

    def _swap_step(self, optim: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """``optim.step(closure)`` through the pipeline; outside ``step()``, then ``_after_step()``."""
        loss = self._steps.run(optim, closure)
        if not self._in_container_step:
            self._after_step()
        return loss

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Flat ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>`` dict over the host cache
        (less what a loading checkpoint lacks: :meth:`loading_checkpoint`)."""
        flat = _flat.flat_state_dict(self.model_parts, self.optimizers, self.param_to_cpu_states_map)
        flat.update(self.unswapped.state_dict())
        return flat if self._loading_keys is None else match_template(flat, self._loading_keys)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a flat state dict; validated first, a failure leaves the container untouched."""
        try:
            self._loader.load(state_dict)
            self.unswapped.load_state_dict(state_dict)
        finally:
            # Caches may be new, groups changed (a rollback restores copies): replan.
            self._steps.invalidate()

    @contextlib.contextmanager
    def loading_checkpoint(self, keys: Collection[str]) -> Iterator[None]:
        """``state_dict()`` is the template of a checkpoint holding optimizer keys in the block
        (:func:`match_template`: DCP's strict load fails on every key the checkpoint lacks)."""
        previous, self._loading_keys = self._loading_keys, frozenset(keys)
        try:
            yield
        finally:
            self._loading_keys = previous

    # The seed's names for the state-dict helpers (its tests call some on the class).
    @_instance_or_class_method
    def _state_value_for_state_dict(self, param: Any, state: Mapping[str, Any], key: str) -> Any:
        return _flat.state_value(self.param_to_cpu_states_map, param, state, key)

    _tensor_for_state_dict = staticmethod(_flat.tensor_for_state_dict)
    _move_step_to_device = staticmethod(_flat.move_step_to_device)
    _fqns_by_param = staticmethod(fqns_by_param)
    _clone_loaded_state_for_device_placeholder = staticmethod(placeholder_like)

    # -- hooks for subclasses ------------------------------------------------------------
    def _allocate_host_cache(self, entries: Sequence[HostCacheEntry]) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """``{param: {key: tensor}}``: contiguous CPU tensors of ``entry.keys`` and a 0-dim ``STEP_KEY``.
        Default: views of one exactly sized pinned buffer (on CPU, one tensor per moment)."""
        backend = self.device_backend
        if backend.pin_memory_available:
            return flat_host_caches(entries, backend.alloc_host_bytes)
        cache: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        # The steps as one vector: a slice's steps are then incremented as one tensor.
        steps = backend.alloc_host((len(entries),), STEP_DTYPE)
        for index, entry in enumerate(entries):
            tensors = {key: backend.alloc_host(entry.shape, entry.dtype) for key in entry.keys}
            tensors[STEP_KEY] = steps[index]
            cache[entry.param] = tensors
        return cache

    def _before_host_write(self, params: Sequence[torch.Tensor]) -> None:
        """Called before the host cache of ``params`` is overwritten (may block). Default: nothing."""

    def _after_step(self) -> None:
        """Called once per container step, after every offload of the step is complete."""

    def _after_load_state_dict(self) -> None:
        """Called after ``load_state_dict()`` has written the host cache and emptied the cache."""


def _trainable_group(model: nn.Module) -> list[dict[str, Any]]:
    """torchtitan's default: one param group of every trainable parameter."""
    return [{"params": [param for param in model.parameters() if param.requires_grad]}]


def bind_swap_step(container: Any, optim: Optimizer) -> Callable[..., Any]:
    """``optim.step`` bound to the swap pipeline, with torch's step hooks: a method, so that LR
    schedulers can wrap it; the container held weakly."""
    owner_ref = weakref.ref(container)

    def swap_step(optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        owner = owner_ref()
        if owner is None:
            raise RuntimeError("the SwapOptimizersContainer of this optimizer no longer exists")
        return owner._swap_step(optimizer, closure)

    swap_step.__qualname__ = f"{type(optim).__name__}.swap_step"
    return types.MethodType(Optimizer.profile_hook_step(swap_step), optim)
