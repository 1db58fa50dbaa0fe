"""Pure helpers of the swap optimizer: slice planning and the Adam/AdamW update calls, in the implementation a group's
``fused`` / ``foreach`` flags select as torch reads them, bit-identical to torch's. Adam's update is elementwise, so
slice by slice gives the same bits as one call."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as torch_functional_adam
from torch.optim.optimizer import _device_dtype_check_for_fused, _to_scalar

from swap_state.client.optim.dtensor_utils import DTensor, unwrap_dtensor
from swap_state.client.optim.host_cache import (
    MOMENT_KEYS, STEP_KEY, HostCache, SliceStates, host_cache_ready, steps_vector)

__all__ = [
    "DEFAULT_IMPLEMENTATION", "IMPLEMENTATIONS", "PendingSlice", "SlicePlan", "SliceWork", "adam_update",
    "grad_on_param_placements", "PlacementError", "checked_slice", "full_slice_work", "fused_check_passes",
    "group_implementation", "pin_default_implementation", "plan_slice", "plan_slices", "slice_work", "steps_on_device"]

#: torchtitan's ``optimizer.implementation`` values, each run as torch runs it.
IMPLEMENTATIONS: tuple[str, ...] = ("fused", "foreach", "for-loop")
#: What a group with ``fused=None`` and ``foreach=None`` runs (torch would pick by device).
DEFAULT_IMPLEMENTATION = "fused"


def group_implementation(group: Mapping[str, Any]) -> str:
    """The update ``group``'s flags select, as ``torch.optim.adam.adam`` (both None: the default)."""
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused is None and foreach is None:
        return DEFAULT_IMPLEMENTATION
    return "fused" if fused else "foreach" if foreach else "for-loop"


def pin_default_implementation(group: dict[str, Any]) -> None:
    """A group with neither ``fused`` nor ``foreach`` set gets ``fused=True``, what it runs (a
    checkpoint then resumes on the same kernel)."""
    if group.get("fused") is None and group.get("foreach") is None:
        group["fused"] = DEFAULT_IMPLEMENTATION == "fused"


def steps_on_device(group: Mapping[str, Any]) -> bool:
    """Whether torch keeps ``group``'s step counts on the device (fused or capturable)."""
    return group_implementation(group) == "fused" or bool(group.get("capturable", False))


class PlacementError(RuntimeError):
    """A gradient that cannot be brought to its parameter's placements (``param``)."""

    def __init__(self, message: str, param: torch.Tensor):
        super().__init__(message)
        self.param = param


def grad_on_param_placements(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` redistributed to ``param``'s placements, as torch's DTensor dispatch of the fused Adam does."""
    param_is, grad_is = isinstance(param, DTensor), isinstance(grad, DTensor)
    if not param_is and not grad_is:
        return grad
    if param_is and grad_is and grad.placements == param.placements:
        return grad
    if param_is and grad_is and grad.device_mesh == param.device_mesh:
        return grad.redistribute(param.device_mesh, param.placements)
    raise PlacementError(
        f"the gradient has {grad.placements if grad_is else 'no placements (a plain tensor)'}, the "
        f"parameter {param.placements if param_is else 'none (a plain tensor)'}"
        + (" on another device mesh" if param_is and grad_is else "")
        + ": SwapOptimizersContainer updates local shards and cannot bring one to the other",
        param)


def fused_check_passes(local_param: torch.Tensor, group: Mapping[str, Any]) -> bool:
    """Whether ``local_param`` passes the fused kernel's device and dtype check (if fused)."""
    if group_implementation(group) != "fused":
        return True
    try:
        _device_dtype_check_for_fused(local_param)
    except RuntimeError:
        return False
    return True


def plan_slices(sizes: Sequence[int], times: int) -> list[range]:
    """Split items of byte ``sizes`` into at most ``times`` contiguous runs, by each item's byte midpoint."""
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    total = sum(sizes)
    if total == 0:
        return [range(len(sizes))] if sizes else []
    slices: list[range] = []
    start, current, before = 0, 0, 0
    for index, size in enumerate(sizes):
        # In integers: a float loses bytes above 2^53.
        target = min(times - 1, (2 * before + size) * times // (2 * total))
        if target != current:
            slices.append(range(start, index))
            start, current = index, target
        before += size
    slices.append(range(start, len(sizes)))
    return [run for run in slices if len(run)]


def adam_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], state_steps: list[torch.Tensor],
                *, group: Mapping[str, Any], grad_scale: torch.Tensor | None = None,
                found_inf: torch.Tensor | None = None, steps: torch.Tensor | None = None, upcast: bool = False) -> None:
    """One Adam/AdamW update of local tensors in ``group``'s implementation, steps incremented as
    torch does. ``upcast``: moments of a lower precision than CPU parameters. ``steps``: the vector
    ``state_steps`` are views of (or None); with one fused kernel call it takes one ``add_``
    instead of a CPU foreach's one op per tensor (the same float32 ``+ 1``)."""
    if not params:
        return
    if upcast:
        # Lower-precision moments on the CPU, where torch has no mixed-precision kernel: what the
        # CUDA one does, in three steps (upcast, update, ``copy_`` back rounding to nearest even).
        moments = (exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
        wide = [[moment.to(param.dtype) for moment, param in zip(kind, params)] for kind in moments]
        adam_update(params, grads, *wide, state_steps, group=group, grad_scale=grad_scale, found_inf=found_inf,
                    steps=steps)
        for kind, values in zip(moments, wide):
            for moment, value in zip(kind, values):
                moment.copy_(value)
        return
    implementation = group_implementation(group)
    beta1, beta2 = group["betas"]
    if implementation != "fused":
        capturable = bool(group.get("capturable", False))
        if implementation == "foreach" and isinstance(group["lr"], torch.Tensor) and not capturable:
            # Adam._init_group's check, word for word.
            raise RuntimeError("lr as a Tensor is not supported for capturable=False and foreach=True")
        torch_functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
            foreach=implementation == "foreach", capturable=capturable, fused=False,
            differentiable=bool(group.get("differentiable", False)),
            grad_scale=grad_scale, found_inf=found_inf,
            has_complex=any(torch.is_complex(p) for p in params),
            decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)), amsgrad=group["amsgrad"],
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"],
        )  # fmt: skip
        return
    # torch's _fused_adam for tensors already gathered (differentiable was refused when checked).
    beta1, beta2 = _to_scalar(beta1), _to_scalar(beta2)
    lr = group["lr"]
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    moves_lr = isinstance(lr, torch.Tensor) and str(lr.device) != "cpu"  # as torch: moved to each device
    tensors = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps]
    grouped = Optimizer._group_tensors_by_device_and_dtype(tensors)  # type: ignore[arg-type]
    vector = steps if len(grouped) == 1 else None  # then d_steps is state_steps, in order
    for (device, _), ((d_params, d_grads, d_avgs, d_sqs, d_max, d_steps), _) in grouped.items():
        device_lr = _on_device(lr, device) if moves_lr else lr
        device_scale, device_inf = _on_device(grad_scale, device), _on_device(found_inf, device)
        _add_to_steps(vector, d_steps)
        kernel(
            d_params, d_grads, d_avgs, d_sqs, d_max, d_steps,
            amsgrad=group["amsgrad"], lr=device_lr, beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            grad_scale=device_scale, found_inf=device_inf,
        )  # fmt: skip
        if device_inf is not None:
            _add_to_steps(vector, d_steps, minus=device_inf)


def _add_to_steps(vector: torch.Tensor | None, steps: list[torch.Tensor], minus: Any = None) -> None:
    """``+ 1`` (or ``- minus``) on every step, or in one op on ``vector``, their base."""
    if vector is not None:
        vector.add_(1) if minus is None else vector.sub_(minus)
    elif minus is None:
        torch._foreach_add_(steps, 1)
    else:
        torch._foreach_sub_(steps, [minus] * len(steps))


def _on_device(tensor: torch.Tensor | None, device: torch.device) -> Any:
    return None if tensor is None else tensor.to(device=device, non_blocking=True)


# -- slices: per-parameter facts planned once, checked per step --------------------
@dataclass(eq=False)
class SliceWork:
    """A slice's parameters with a gradient, in update order; ``runs``: ``(group, start, end)`` each."""

    params: list[torch.Tensor]
    local_params: list[torch.Tensor]
    local_grads: list[torch.Tensor]
    host: SliceStates
    runs: list[tuple[dict[str, Any], int, int]]


@dataclass(eq=False)
class SlicePlan:
    """A slice, its parameters' groups and host caches (None while incomplete); ``full``: its work
    where every parameter can take the fast path (gradients and shards filled in per step)."""

    params: list[torch.Tensor]
    groups: list[dict[str, Any]]
    hosts: list[HostCache | None]
    full: SliceWork | None
    dtensor: bool


PendingSlice = tuple[SlicePlan, list[int], list[torch.Tensor], list[torch.Tensor]]
"""A slice on the per-parameter path: its plan, and :func:`checked_slice`'s result."""


def plan_slice(params: list[torch.Tensor], groups: list[dict[str, Any]],
               caches: Mapping[torch.Tensor, Any]) -> SlicePlan:
    """The plan of one slice; the fused kernel's device and dtype check is made here, once, as torch does."""
    hosts: list[HostCache | None] = []
    kinds = set()
    full = True
    for param, group in zip(params, groups, strict=True):
        kinds.add(isinstance(param, DTensor))
        local = unwrap_dtensor(param)
        host = caches.get(param)
        ready = host_cache_ready(host, group) and host.get(STEP_KEY) is not None  # type: ignore[union-attr]
        hosts.append(host if ready else None)
        full = full and ready and not group.get("differentiable", False) and fused_check_passes(local, group)
    full = full and len(kinds) == 1
    work = slice_work(params, groups, [], [], hosts) if full else None  # type: ignore[arg-type]
    return SlicePlan(params, groups, hosts, work, True in kinds)


def full_slice_work(planned: SlicePlan, grads: list[Any]) -> SliceWork | None:
    """The planned work of a slice's parameters with a gradient, if those pass the per-step checks."""
    full = planned.full
    if full is None:
        return None
    present, indices = grads, None
    if any(grad is None for grad in grads):  # as torch: no gradient, no update, no step increment
        indices = [index for index, grad in enumerate(grads) if grad is not None]
        if not indices:
            return None
        present = [grads[index] for index in indices]
    params = full.params if indices is None else [full.params[index] for index in indices]
    if planned.dtensor:
        pairs = zip(params, present, strict=True)
        fits = all(isinstance(grad, DTensor) and grad.placements == param.placements for param, grad in pairs)
    else:
        fits = all(type(grad) is torch.Tensor for grad in present)
    if not fits or any(grad.is_sparse for grad in present):
        return None
    local_params, local_grads = params, present  # a plain tensor is its own local shard
    if planned.dtensor:
        local_params, local_grads = [unwrap_dtensor(p) for p in params], [unwrap_dtensor(g) for g in present]
    if indices is None:
        return dataclasses.replace(full, local_params=local_params, local_grads=local_grads)
    groups, hosts = [planned.groups[i] for i in indices], [planned.hosts[i] for i in indices]
    return slice_work(params, groups, local_params, local_grads, hosts)  # type: ignore[arg-type]


def checked_slice(planned: SlicePlan, grads: list[Any]) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """The per-parameter path: indices with a gradient and their local shards, checked."""
    indices, local_params, local_grads = [], [], []
    for index, (param, grad) in enumerate(zip(planned.params, grads, strict=True)):
        if grad is None:
            continue  # as torch: no gradient, no update, no step increment
        group = planned.groups[index]
        if grad.is_sparse:
            raise RuntimeError("SwapOptimizersContainer does not support sparse gradients, please consider "
                               "SparseAdam instead")
        if group.get("differentiable", False):
            raise RuntimeError("SwapOptimizersContainer does not support differentiable=True")
        grad = grad_on_param_placements(param, grad)
        local_param, local_grad = unwrap_dtensor(param), unwrap_dtensor(grad)
        if group_implementation(group) == "fused":
            _device_dtype_check_for_fused(local_param)  # torch's fused Adam's check
        indices.append(index)
        local_params.append(local_param)
        local_grads.append(local_grad)
    return indices, local_params, local_grads


def slice_work(params: list[torch.Tensor], groups: list[dict[str, Any]], local_params: list[torch.Tensor],
               local_grads: list[torch.Tensor], hosts: list[HostCache]) -> SliceWork:
    """A slice's work over complete host caches ``hosts`` (parallel lists)."""
    runs: list[tuple[dict[str, Any], int, int]] = []
    for index, group in enumerate(groups):
        if runs and runs[-1][0] is group:
            runs[-1] = (group, runs[-1][1], index + 1)
        else:
            runs.append((group, index, index + 1))
    tensors = {key: [host.get(key) for host in hosts] for key in (*MOMENT_KEYS, STEP_KEY)}
    host = SliceStates(tensors, steps_vector(tensors[STEP_KEY]))
    return SliceWork(params, local_params, local_grads, host, runs)
