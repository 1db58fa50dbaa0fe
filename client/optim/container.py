"""``SwapOptimizersContainer``: torchtitan's ``OptimizersContainer`` with Adam moments in host memory.

The class is assembled from one mixin per job: :mod:`~swap_state.client.optim.host_cache`,
:mod:`~swap_state.client.optim.step_pipeline`, :mod:`~swap_state.client.optim.flat_state_dict` and
:mod:`~swap_state.client.optim.state_loading`. This module holds construction and the hooks a
subclass overrides. Importing it patches nothing in torchtitan (that is
:mod:`swap_state.client.swap_optimizer`'s job, the seed's module name).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from swap_state.client.optim import patch_points
from swap_state.client.optim.kernels import pin_default_implementation
from swap_state.client.device import DeviceBackend
from swap_state.client.optim.flat_state_dict import FlatStateDictMixin
from swap_state.client.optim.host_cache import (
    STEP_DTYPE,
    STEP_KEY,
    HostCache,
    HostCacheEntry,
    HostCacheMixin,
    group_map,
    step_tensor,
)
from swap_state.client.optim.state_loading import StateLoadingMixin
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES, StepPipelineMixin, bind_swap_step

__all__ = ["SwapOptimizersContainer"]

# The facade's name: what users configure logging for.
logger = logging.getLogger("swap_state.client.swap_optimizer")


class SwapOptimizersContainer(
    StepPipelineMixin, StateLoadingMixin, FlatStateDictMixin, HostCacheMixin, OptimizersContainer
):
    """torchtitan ``OptimizersContainer`` whose Adam/AdamW moments live in host memory.

    ``SwapOptimizersContainer(model_parts, optimizer_cls, optimizer_kwargs, swap_optimizer_times)``
    builds one ``optimizer_cls`` per model part as torchtitan does; ``optimizer_cls`` must
    be ``torch.optim.Adam`` or ``AdamW`` (or a subclass). The update is the implementation
    the param group's flags select, as torch selects it: ``fused=True`` the fused kernel,
    ``foreach=True`` torch's foreach update, both False its for-loop (torchtitan's
    ``optimizer.implementation``), each bit-identical to torch's Adam/AdamW with the same
    flags; neither given (both None) runs the fused kernel and records ``fused=True`` in
    the group (:mod:`swap_state.client.optim.kernels`).

    Keyword-only extras: ``param_groups(model_part) -> list[dict]`` to build param groups
    (default: one group of every trainable parameter), ``device_backend`` (default:
    ``get_torch_device()``), ``pipeline`` (default: on iff the backend is an accelerator;
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
        self._device_backend = device_backend or patch_points.get_torch_device()
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
            optim.param_to_group_map = group_map(optim)  # type: ignore[attr-defined]
            for group in optim.param_groups:
                group.setdefault(STEP_KEY, step_tensor(0))
                pin_default_implementation(group)
            pairs = [(gi, p) for gi, g in enumerate(optim.param_groups) for p in g["params"]]
            entries.extend(self._host_cache_entries(index, model, optim, pairs))
        seen: set[int] = set()
        for entry in entries:
            if id(entry.param) in seen:
                raise ValueError(f"parameter {entry.fqn!r} is in more than one optimizer or group")
            seen.add(id(entry.param))
        self._install_host_caches(entries)
        for optim in self.optimizers:
            optim.step = bind_swap_step(self, optim)  # type: ignore[method-assign]
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
        contiguous) and ``STEP_KEY`` (0-dim ``STEP_DTYPE``), holding either zeros or
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
