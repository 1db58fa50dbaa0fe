"""The swap step: per optimizer, ``swap_optimizer_times`` byte-balanced slices, each loaded (H2D), updated and offloaded
(D2H) on three streams, so that slice k+1 loads while slice k updates; every step, even one that raises, ends with no
copy in flight. On CPU the update runs in place."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.optim.dtensor_utils import unwrap_dtensor
from swap_state.client.optim.kernels import (
    PendingSlice, SlicePlan, SliceWork, adam_update, PlacementError, checked_slice, full_slice_work,
    group_implementation, plan_slice, plan_slices, slice_work, steps_on_device)
from swap_state.client.device import DeviceBackend
from swap_state.client.optim.host_cache import (
    MOMENT_KEYS, HostCaches, STEP_DTYPE, STEP_KEY, SliceStates, advance_group_step, as_number, group_map,
    host_cache_ready, step_tensor)

__all__ = ["DEFAULT_SWAP_TIMES", "StepPipeline"]

DEFAULT_SWAP_TIMES = 16

_T = TypeVar("_T")


@dataclass(eq=False)
class _LoadedSlice:
    """Device state of one slice and the event its loads end with."""

    work: SliceWork
    device: SliceStates
    ready: Any


class StepPipeline:
    """The swap step of the optimizers ``host_caches`` holds, in ``swap_times`` slices; ``pipeline``: None
    runs the load/offload pipeline iff the device is an accelerator, True on CPU too."""

    def __init__(self, host_caches: HostCaches, backend: DeviceBackend, model_parts: Sequence[nn.Module],
                 swap_times: int, *, pipeline: bool | None = None):
        self._host_caches = host_caches
        self._backend = backend
        self._model_parts = model_parts
        self._swap_times = swap_times
        self._pipeline = pipeline
        self._plans: dict[int, tuple[tuple[Any, ...], list[SlicePlan]]] = {}

    def run(self, optim: Optimizer, closure: Callable[[], _T] | None = None) -> _T | None:
        """``optim.step(closure)`` through the host cache (torch's step hooks still apply)."""
        if torch.jit.is_scripting():
            raise RuntimeError("torch.jit.script is not supported by SwapOptimizersContainer")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._host_caches.store.before_step()
            slices = self._collect_step_work(optim)
            for group in optim.param_groups:
                advance_group_step(group)
            if self.enabled():
                self._pipelined_update(optim, slices)
            else:  # CPU: the fused kernel updates the host cache directly, slice by slice
                for work in slices:
                    self._host_caches.store.before_write(work.params)
                    self._fused_update(optim, work, work.host)
        return loss

    def enabled(self) -> bool:
        """Whether the load/offload pipeline runs (else the update runs on the host cache)."""
        return self._backend.is_accelerator if self._pipeline is None else self._pipeline

    def invalidate(self) -> None:
        """Forget the per-parameter plans: the host caches may have been replaced (a load)."""
        self._plans.clear()

    def _plan_for(self, optim: Optimizer) -> list[SlicePlan]:
        """``optim``'s slices with their per-parameter facts, rebuilt when one could have changed."""
        caches = self._host_caches.cpu_states
        key = (
            tuple((id(group), tuple(map(id, group["params"]))) for group in optim.param_groups),
            tuple((group_implementation(g), bool(g.get("amsgrad")), bool(g.get("differentiable")))
                  for g in optim.param_groups),
            id(caches), len(caches), self._host_caches.epoch,
        )  # fmt: skip
        cached = self._plans.get(id(optim))
        if cached is None or cached[0] != key:
            params = [param for group in optim.param_groups for param in group["params"]]
            sizes = [unwrap_dtensor(p).numel() * p.element_size() for p in params]
            optim.param_to_group_map = groups = group_map(optim)  # type: ignore[attr-defined]
            slices = [plan_slice([params[i] for i in run], [groups[params[i]] for i in run], caches)
                      for run in plan_slices(sizes, self._swap_times)]
            self._plans[id(optim)] = cached = (key, slices)
        return cached[1]

    def _collect_step_work(self, optim: Optimizer) -> list[SliceWork]:
        """The parameters with gradients, per slice, all validated before any change; a slice
        that fails the fast checks takes the per-parameter path, which raises torch's errors."""
        slices: list[SliceWork] = []
        pending: list[PendingSlice] = []
        for planned in self._plan_for(optim):
            grads = [param.grad for param in planned.params]
            work = full_slice_work(planned, grads)
            if work is not None:
                slices.append(work)
                continue
            try:
                checked = checked_slice(planned, grads)
            except PlacementError as exc:
                raise RuntimeError(f"parameter {self._name_of(exc.param)}: {exc}") from None
            if checked[0]:
                pending.append((planned, *checked))
                slices.append(None)  # type: ignore[arg-type]  # filled in below
        if pending:
            completed = iter(self._complete_host_caches(optim, pending))
            slices = [work if work is not None else next(completed) for work in slices]
        return slices

    def _name_of(self, param: torch.Tensor) -> str:
        """The parameter's name in its model part (for an error message)."""
        named = (name for part in self._model_parts for name, candidate in part.named_parameters(remove_duplicate=False)
                 if candidate is param)
        return next(named, f"of shape {tuple(param.shape)}")

    def _complete_host_caches(self, optim: Optimizer, pending: list[PendingSlice]) -> list[SliceWork]:
        """The work of slices on the per-parameter path, missing caches and steps added."""
        caches = self._host_caches.cpu_states
        needed = [(p.params[i], p.groups[i]) for p, idx, _, _ in pending for i in idx if p.hosts[i] is None]
        missing = [(param, group) for param, group in needed if not host_cache_ready(caches.get(param), group)]
        if missing:
            index = next(i for i, o in enumerate(self._host_caches.optimizers) if o is optim)
            group_index = {id(g): gi for gi, g in enumerate(optim.param_groups)}
            pairs = [(group_index[id(group)], param) for param, group in missing]
            self._host_caches.install(self._host_caches.entries(index, self._model_parts[index], optim, pairs))
        for param, group in needed:
            host = caches[param]
            if host.get(STEP_KEY) is None:
                # The seed's layout, without a per-param step: each took the group's steps.
                host[STEP_KEY] = step_tensor(as_number(group.get(STEP_KEY, 0)))
        if needed:
            self.invalidate()
        works = []
        for planned, indices, local_params, local_grads in pending:
            hosts = [planned.hosts[i] or caches[planned.params[i]] for i in indices]
            groups = [planned.groups[i] for i in indices]
            works.append(slice_work([planned.params[i] for i in indices], groups, local_params, local_grads, hosts))
        return works

    def _pipelined_update(self, optim: Optimizer, slices: list[SliceWork]) -> None:
        """Accelerator: update(k) || load(k+1) || offload(k); per slice k, the host waits for the
        offload of k-1 before it enqueues the load of k+1, so at most two slices hold buffers."""
        if not slices:
            return
        load_stream, offload_stream = self._streams
        compute = self._backend.current_stream()
        offloaded: Any = None  # the event the previous slice's offload ends with
        try:
            upcoming = self._load_slice(slices[0], load_stream)
            for index in range(len(slices)):
                current = upcoming
                updated = self._update_slice(optim, current, compute)
                if index + 1 < len(slices):
                    if offloaded is not None:
                        # Bounded device memory: the host runs ahead of an asynchronous
                        # device and would enqueue every load at once, the peak being the
                        # whole moments. The update of slice k keeps the device busy meanwhile.
                        offloaded.synchronize()
                    upcoming = self._load_slice(slices[index + 1], load_stream)
                offloaded = self._offload_slice(current, updated, offload_stream)
        finally:
            # After an exception too: the caller may free or unmap the host memory copied.
            load_stream.synchronize()
            offload_stream.synchronize()

    @functools.cached_property
    def _streams(self) -> tuple[Any, Any]:
        return self._backend.stream(), self._backend.stream()

    def _load_slice(self, work: SliceWork, stream: Any) -> _LoadedSlice:
        """Enqueue H2D copies of ``work``'s host cache on ``stream``, then its ``ready`` event."""
        backend = self._backend
        device = SliceStates({key: [None] * len(work.params) for key in MOMENT_KEYS})
        # Allocated on the load stream; the compute and offload streams are recorded later.
        with backend.use_stream(stream):
            for index, local_param in enumerate(work.local_params):
                for key in MOMENT_KEYS:
                    host = work.host.tensors[key][index]
                    if host is not None:
                        # The host's dtype: bfloat16 moments travel and sit on the device as such.
                        buffer = torch.empty_like(local_param, dtype=host.dtype, memory_format=torch.contiguous_format)
                        backend.copy_to_device(buffer, host)
                        device.tensors[key][index] = buffer
            device.tensors[STEP_KEY], device.steps = _load_steps(backend, work)
            ready = backend.event()
            ready.record(stream)
        return _LoadedSlice(work, device, ready)

    def _update_slice(self, optim: Optimizer, loaded: _LoadedSlice, compute: Any) -> Any:
        """Enqueue the update of ``loaded`` on ``compute`` after its loads; return its end event."""
        backend = self._backend
        compute.wait_event(loaded.ready)
        self._fused_update(optim, loaded.work, loaded.device)
        for _, buffer in _pairs(loaded.work, loaded.device):
            if not (backend.is_accelerator and buffer.device.type == "cpu"):  # a CPU step copy: no stream uses it
                backend.record_stream(buffer, compute)
        updated = backend.event()
        updated.record(compute)
        return updated

    def _offload_slice(self, loaded: _LoadedSlice, updated: Any, stream: Any) -> Any:
        """Enqueue D2H copies of ``loaded`` after ``updated``; return the event they end with."""
        work, device = loaded.work, loaded.device
        self._host_caches.store.before_write(work.params)
        backend = self._backend
        with backend.use_stream(stream):
            stream.wait_event(updated)
            for host, buffer in _pairs(work, device):
                if backend.is_accelerator and buffer.device.type == "cpu":
                    host.copy_(buffer)  # a CPU step copy (torch's layout without fused/capturable)
                else:
                    backend.copy_to_host(host, buffer)
                    backend.record_stream(buffer, stream)
            offloaded = backend.event()
            offloaded.record(stream)
        # Freed before anything else is enqueued on ``stream``: reusable once ``offloaded`` is done.
        device.tensors.clear()
        device.steps = None
        return offloaded

    def _fused_update(self, optim: Optimizer, work: SliceWork, states: SliceStates) -> None:
        """One update call per param group of ``work`` over ``states`` (the name is the seed's)."""
        tensors, steps = states.tensors, states.steps
        grad_scale, found_inf = getattr(optim, "grad_scale", None), getattr(optim, "found_inf", None)
        # bfloat16 moments on the CPU, where torch has no mixed-precision fused kernel.
        upcast = self._host_caches.moment_dtype is not None and work.local_params[0].device.type == "cpu"
        for group, start, end in work.runs:
            adam_update(
                work.local_params[start:end], work.local_grads[start:end], tensors["exp_avg"][start:end],
                tensors["exp_avg_sq"][start:end], tensors["max_exp_avg_sq"][start:end] if group["amsgrad"] else [],
                tensors[STEP_KEY][start:end], group=group, grad_scale=grad_scale, found_inf=found_inf,
                steps=None if steps is None else steps[start:end], upcast=upcast)


def _load_steps(backend: DeviceBackend, work: SliceWork) -> tuple[list[Any], torch.Tensor | None]:
    """The slice's steps where torch keeps them, and the vector they are views of (one copy) or None."""
    host = work.host
    places = {steps_on_device(group) for group, _, _ in work.runs}
    if host.steps is not None and len(places) == 1:
        vector = _load_step(backend, host.steps, places.pop(), work.local_params[0].device)
        return list(vector.unbind()), vector
    steps = [_load_step(backend, host.tensors[STEP_KEY][i], steps_on_device(group), work.local_params[i].device)
             for group, start, end in work.runs for i in range(start, end)]
    return steps, None


def _load_step(backend: DeviceBackend, host: torch.Tensor, on_device: bool, device: Any) -> torch.Tensor:
    """A copy of host steps on ``device``, or on the CPU (torch's layout without fused/capturable)."""
    if not on_device:
        return host.clone()
    step = torch.empty(host.shape, dtype=STEP_DTYPE, device=device)
    backend.copy_to_device(step, host)
    return step


def _pairs(work: SliceWork, device: SliceStates) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(host tensor, device buffer)`` of a slice in host memory order (the step vector, not its views)."""
    keys = MOMENT_KEYS if device.steps is not None else (*MOMENT_KEYS, STEP_KEY)
    pairs = [(work.host.tensors[key][index], buffer) for index in range(len(work.params)) for key in keys
             if (buffer := device.tensors[key][index]) is not None]
    if device.steps is not None:
        pairs.append((work.host.steps, device.steps))  # type: ignore[arg-type]
    return pairs
