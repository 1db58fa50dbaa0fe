"""The swap step: moments stream through the accelerator in slices, or update in place on CPU.

Per optimizer, the parameters (in update order) are cut into ``swap_optimizer_times``
byte-balanced slices. On an accelerator, per slice::

    load (H2D, load stream) -> fused Adam/AdamW (compute stream) -> offload (D2H, offload stream)

with events between the streams, so slice k+1 loads while slice k updates and offloads.
Before it enqueues the load of slice k+1, the host waits until the offload of slice k-1 has
completed: at most two slices hold device buffers at a time, however far an asynchronous
device lags the host (:meth:`StepPipeline._pipelined_update`). Every step, even one that
raises, ends with no copy in flight. On a CPU-only process the update runs directly on the
host cache. The update is the param group's implementation, as torch picks it from the
group's ``fused`` / ``foreach`` flags (torchtitan's ``optimizer.implementation``: "fused",
"foreach" or "for-loop"; :mod:`swap_state.client.optim.kernels`), so results are
bit-identical to torch's Adam/AdamW with the same implementation. Without ``fused`` or
``capturable`` torch keeps step counts on the CPU: so does the pipeline (a CPU copy per slice
instead of a device one).

Each optimizer's ``step`` is bound to its container's ``_swap_step`` (:func:`bind_swap_step`),
which runs :meth:`StepPipeline.run`; ``torch.optim.Adam.step`` itself is never patched.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _device_dtype_check_for_fused

from swap_state.client.optim import patch_points
from swap_state.client.optim.kernels import adam_update, group_implementation, plan_slices, steps_on_device
from swap_state.client.device import DeviceBackend
from swap_state.client.optim.dtensor_utils import DTensor
from swap_state.client.optim.host_cache import (
    HostCaches,
    STEP_DTYPE,
    STEP_KEY,
    HostCache,
    as_number,
    group_map,
    host_cache_ready,
    moment_keys,
    step_tensor,
)

if TYPE_CHECKING:
    from swap_state.client.optim.owner import SwapContainer

__all__ = ["DEFAULT_SWAP_TIMES", "StepPipeline", "advance_group_step", "bind_swap_step"]

DEFAULT_SWAP_TIMES = 16

_T = TypeVar("_T")


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


class StepPipeline:
    """The swap step of a container's optimizers, held by the container.

    ``run(optim, closure)`` is one optimizer's update; the container's ``step()`` runs it for
    each optimizer and then its ``_after_step`` hook. The container's ``_before_host_write``
    hook is called before each slice's host bytes change, and ``_allocate_host_cache`` (through
    the host caches) for parameters without a cache. ``pipeline``: None runs the load/offload
    pipeline iff the device is an accelerator; True runs it on CPU too, with CPU "device"
    buffers. The pipeline holds at most two slices' device buffers at a time and leaves no
    copy in flight when ``run`` returns or raises.
    """

    def __init__(self, owner: SwapContainer, host_caches: HostCaches, *, pipeline: bool | None = None):
        self._owner = owner
        self._host_caches = host_caches
        self._pipeline = pipeline
        self._swap_streams: tuple[Any, Any] | None = None
        self._slice_cache: dict[int, tuple[Any, list[list[torch.Tensor]]]] = {}

    def run(self, optim: Optimizer, closure: Callable[[], _T] | None = None) -> _T | None:
        """``optim.step(closure)``: one optimizer's update through the host cache (the
        container calls it from the bound ``optim.step``, so torch's step hooks and
        LR-scheduler tracking still apply)."""
        if torch.jit.is_scripting():
            raise RuntimeError("torch.jit.script is not supported by SwapOptimizersContainer")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            slices = self._collect_step_work(optim)
            for group in optim.param_groups:
                advance_group_step(group)
            if self.enabled():
                self._pipelined_update(optim, slices)
            else:
                self._inplace_update(optim, slices)
        return loss

    def enabled(self) -> bool:
        """Whether the load/offload pipeline runs (else the update runs on the host cache)."""
        return self._owner.device_backend.is_accelerator if self._pipeline is None else self._pipeline

    def _slices_for(self, optim: Optimizer) -> list[list[torch.Tensor]]:
        """``optim``'s parameters in update order, cut into byte-balanced slices (cached)."""
        signature = tuple((id(group), tuple(map(id, group["params"]))) for group in optim.param_groups)
        cache = self._slice_cache
        cached = cache.get(id(optim))
        if cached is None or cached[0] != signature:
            params = [param for group in optim.param_groups for param in group["params"]]
            sizes = [patch_points.unwrap_dtensor(p).numel() * p.element_size() for p in params]
            slices = [[params[i] for i in run] for run in plan_slices(sizes, self._owner.swap_optimizer_times)]
            optim.param_to_group_map = group_map(optim)  # type: ignore[attr-defined]
            cache[id(optim)] = cached = (signature, slices)
        return cached[1]

    def _collect_step_work(self, optim: Optimizer) -> list[list[_StepItem]]:
        """The parameters with gradients, per slice; validates them all before any change."""
        planned = self._slices_for(optim)  # also refreshes optim.param_to_group_map
        groups: dict[torch.Tensor, dict[str, Any]] = optim.param_to_group_map  # type: ignore[attr-defined]
        slices: list[list[_StepItem]] = []
        for params in planned:
            items = []
            for param in params:
                if param.grad is None:
                    continue  # as torch: no gradient, no update, no step increment
                group = groups[param]
                local_param, local_grad = _checked_param_and_grad(param, param.grad, group)
                host = self._owner.param_to_cpu_states_map.get(param)
                items.append(_StepItem(param, group, local_param, local_grad, host or {}))
            if items:
                slices.append(items)
        self._complete_host_caches(optim, [item for items in slices for item in items])
        return slices

    def _complete_host_caches(self, optim: Optimizer, items: list[_StepItem]) -> None:
        """Allocate caches for parameters that have none; add a missing per-param step."""
        missing = [item for item in items if not host_cache_ready(item.host, item.group)]
        if missing:
            owner = self._owner
            index = next(i for i, o in enumerate(owner.optimizers) if o is optim)
            group_index = {id(g): gi for gi, g in enumerate(optim.param_groups)}
            pairs = [(group_index[id(item.group)], item.param) for item in missing]
            self._host_caches.install(self._host_caches.entries(index, owner.model_parts[index], optim, pairs))
            for item in missing:
                item.host = owner.param_to_cpu_states_map[item.param]
        for item in items:
            if item.host.get(STEP_KEY) is None:
                # A cache built without a per-param step (the seed's layout): every
                # parameter has taken the group's steps so far.
                item.host[STEP_KEY] = step_tensor(as_number(item.group.get(STEP_KEY, 0)))

    def _inplace_update(self, optim: Optimizer, slices: list[list[_StepItem]]) -> None:
        """CPU: the fused kernel updates the host cache directly, slice by slice."""
        for items in slices:
            self._owner._before_host_write([item.param for item in items])
            self._fused_update(optim, items, [item.host for item in items])

    def _pipelined_update(self, optim: Optimizer, slices: list[list[_StepItem]]) -> None:
        """Accelerator: update(k) || load(k+1) || offload(k), then wait for all offloads.

        Call order, per slice k: enqueue the update of slice k (after its load); the host
        waits until the offload of slice k-1 has completed; enqueue the load of slice k+1,
        then the offload of slice k (after its update). So at most two slices hold device
        buffers at once (the one updating or offloading, and the one loading), whatever the
        device's speed. On every exit, normal or an exception, the host waits for both side
        streams: no copy of this step is still in flight when ``run`` returns or raises.
        """
        if not slices:
            return
        load_stream, offload_stream = self._streams()
        compute = self._owner.device_backend.current_stream()
        offloaded: Any = None  # the event the previous slice's offload ends with
        try:
            upcoming = self._load_slice(slices[0], load_stream)
            for index in range(len(slices)):
                current = upcoming
                updated = self._update_slice(optim, current, compute)
                if index + 1 < len(slices):
                    if offloaded is not None:
                        # Bounded device memory. The host runs ahead of an asynchronous
                        # device: without this wait it would enqueue every slice's load at
                        # once, and the caching allocator keeps a freed buffer until the
                        # streams it was used on (record_stream) have passed it, so the peak
                        # would be the whole moments. Slice k-1's offload completing frees its
                        # buffers for slice k+1's load; the update of slice k, enqueued
                        # before the wait, keeps the device busy meanwhile. Simpler than a
                        # ring of preallocated buffers (no fixed slice shapes, no extra copy).
                        offloaded.synchronize()
                    upcoming = self._load_slice(slices[index + 1], load_stream)
                offloaded = self._offload_slice(current, updated, offload_stream)
        finally:
            # After an exception too: the copies enqueued so far read and write device buffers
            # and host memory (a segment) that the caller may free or unmap once step() raised.
            load_stream.synchronize()
            offload_stream.synchronize()

    def _streams(self) -> tuple[Any, Any]:
        """``(load, offload)`` side streams, created on first use."""
        if self._swap_streams is None:
            backend = self._owner.device_backend
            self._swap_streams = (backend.stream(), backend.stream())
        return self._swap_streams

    def _load_slice(self, items: list[_StepItem], stream: Any) -> _LoadedSlice:
        """Enqueue H2D copies of ``items``' host cache on ``stream``; record ``ready`` after."""
        backend = self._owner.device_backend
        buffers = []
        # Allocated while ``stream`` is current, so the caching allocator ties the blocks
        # to the load stream; the compute and offload streams are recorded later.
        with backend.use_stream(stream):
            for item in items:
                device_state = {}
                for key in moment_keys(item.group):
                    buffer = torch.empty_like(item.local_param, memory_format=torch.contiguous_format)
                    backend.copy_to_device(buffer, item.host[key])  # type: ignore[arg-type]
                    device_state[key] = buffer
                if steps_on_device(item.group):
                    step = torch.empty((), dtype=STEP_DTYPE, device=item.local_param.device)
                    backend.copy_to_device(step, item.host[STEP_KEY])  # type: ignore[arg-type]
                else:  # torch's layout without fused/capturable: the step stays on the CPU
                    step = item.host[STEP_KEY].clone()  # type: ignore[union-attr]
                device_state[STEP_KEY] = step
                buffers.append(device_state)
            ready = backend.event()
            ready.record(stream)
        return _LoadedSlice(items, buffers, ready)

    def _update_slice(self, optim: Optimizer, loaded: _LoadedSlice, compute: Any) -> Any:
        """Enqueue the update of ``loaded`` on ``compute`` after its loads; return the event the
        update ends with. Call after :meth:`_load_slice` of ``loaded``, before its offload."""
        backend = self._owner.device_backend
        compute.wait_event(loaded.ready)
        self._fused_update(optim, loaded.items, loaded.buffers)
        for buffers in loaded.buffers:
            for buffer in buffers.values():
                _record_stream(backend, buffer, compute)
        updated = backend.event()
        updated.record(compute)
        return updated

    def _offload_slice(self, loaded: _LoadedSlice, updated: Any, stream: Any) -> Any:
        """Enqueue D2H copies of ``loaded`` after ``updated``; drop the device buffers; return
        the event the copies end with (once it has completed, the buffers' memory is free)."""
        self._owner._before_host_write([item.param for item in loaded.items])
        backend = self._owner.device_backend
        with backend.use_stream(stream):
            stream.wait_event(updated)
            for item, buffers in zip(loaded.items, loaded.buffers, strict=True):
                for key, buffer in buffers.items():
                    _copy_back(backend, item.host[key], buffer)  # type: ignore[arg-type]
                    _record_stream(backend, buffer, stream)
            offloaded = backend.event()
            offloaded.record(stream)
        # Freed here (the loop's last references at the return), before anything else is
        # enqueued on ``stream``: the allocator's free-time event there is then not later
        # than ``offloaded``, so the memory is reusable as soon as ``offloaded`` completes.
        loaded.buffers.clear()
        return offloaded

    def _fused_update(
        self, optim: Optimizer, items: list[_StepItem], states: Sequence[Mapping[str, Any]]
    ) -> None:
        """One update call per param group over ``items`` with state tensors ``states``, in
        the group's implementation (fused unless its flags say foreach or for-loop; the
        name is the seed's)."""
        by_group: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            by_group.setdefault(id(item.group), []).append(index)
        for indices in by_group.values():
            group = items[indices[0]].group
            adam_update(
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


def _copy_back(backend: DeviceBackend, host: torch.Tensor, buffer: torch.Tensor) -> None:
    """Offload ``buffer`` into ``host`` on the current stream: through
    :meth:`DeviceBackend.copy_to_host` (the bounce ring where registered memory is not honoured
    as pinned), except a CPU step copy next to accelerator buffers (torch's layout without
    fused/capturable), which is a host copy."""
    if backend.is_accelerator and buffer.device.type == "cpu":
        host.copy_(buffer)
    else:
        backend.copy_to_host(host, buffer)


def _record_stream(backend: DeviceBackend, tensor: torch.Tensor, stream: Any) -> None:
    """``backend.record_stream``, except for a CPU step copy next to accelerator buffers
    (no stream uses it)."""
    if not (backend.is_accelerator and tensor.device.type == "cpu"):
        backend.record_stream(tensor, stream)


def advance_group_step(group: dict[str, Any]) -> None:
    """The group's step counts container steps (the seed keeps it; checkpoints carry it)."""
    step = group.get(STEP_KEY)
    if isinstance(step, torch.Tensor):
        step += 1
    else:
        group[STEP_KEY] = step_tensor(as_number(step or 0) + 1)


def _checked_param_and_grad(
    param: torch.Tensor, grad: torch.Tensor, group: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local shards of ``param`` and ``grad``, after the checks torch's fused Adam makes."""
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
    local_param, local_grad = patch_points.unwrap_dtensor(param), patch_points.unwrap_dtensor(grad)
    if group_implementation(group) == "fused":
        _device_dtype_check_for_fused(local_param)
    return local_param, local_grad


def bind_swap_step(container: Any, optim: Optimizer) -> Callable[..., Any]:
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
