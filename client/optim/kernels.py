"""Pure helpers of the swap optimizer: slice planning and the Adam/AdamW update calls.

Slices: :func:`plan_slices` cuts an optimizer's parameters into byte-balanced slices;
:func:`plan_slice` records per slice what holds between steps (each parameter's group and host
cache, the fused kernel's device and dtype check, made once as torch makes it when it creates
a parameter's state); per step, :func:`full_slice_work` makes torch's per-step checks (no
sparse gradient, DTensor placements) in one pass over the slice's gradients, and
:func:`checked_slice` is the per-parameter path (a missing gradient, a cache to complete, or a
check that fails: it raises torch's errors).

A param group's *implementation* is torch's (and torchtitan's ``optimizer.implementation``):
``"fused"``, ``"foreach"`` or ``"for-loop"``, read from the group's ``fused`` / ``foreach``
flags exactly as ``torch.optim.Adam.step`` reads them (:func:`group_implementation`), so a
checkpoint's flags take effect on load as they do for torch. One exception, documented: a
group with neither flag set (both None) runs the fused kernel, where torch would pick by
device (the container records it as ``fused=True``, :func:`pin_default_implementation`, so
that its checkpoints resume on the same kernel under torch). :func:`adam_update` runs the
group's implementation:

- ``"fused"``: :func:`fused_adam_update`, torch's ``torch.optim.adam._fused_adam`` restated for
  tensors the caller has already gathered (device buffers or the host cache): the same
  grouping by device and dtype, the same ``grad_scale`` / ``found_inf`` / tensor-``lr``
  handling, the same step increment and the same kernel arguments, so results are
  bit-identical to ``torch.optim.Adam(..., fused=True)`` / ``AdamW(..., fused=True)``;
- ``"foreach"`` / ``"for-loop"``: torch's functional ``torch.optim.adam.adam`` (what
  ``Adam.step`` itself calls) with ``foreach=True`` / ``foreach=False``, ``fused=False``; the
  step counts are CPU tensors then, as torch keeps them without ``fused`` or ``capturable``
  (:func:`steps_on_device`).

Adam's update is elementwise per tensor, so running it slice by slice gives the same bits as
one call over the whole group.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as torch_functional_adam
from torch.optim.optimizer import _device_dtype_check_for_fused, _to_scalar

from swap_state.client.optim import dtensor_utils  # attributes: the seed's tests patch them
from swap_state.client.optim.dtensor_utils import DTensor
from swap_state.client.optim.host_cache import STEP_KEY, HostCache, SliceStates, host_cache_ready, host_states

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "PendingSlice",
    "SlicePlan",
    "SliceWork",
    "adam_update",
    "checked_param_and_grad",
    "grad_on_param_placements",
    "PlacementError",
    "checked_slice",
    "full_slice_work",
    "fused_adam_update",
    "fused_check_passes",
    "group_implementation",
    "pin_default_implementation",
    "plan_slice",
    "plan_slices",
    "slice_work",
    "steps_on_device",
]

#: torchtitan's ``optimizer.implementation`` values, each run as torch runs it.
IMPLEMENTATIONS: tuple[str, ...] = ("fused", "foreach", "for-loop")
#: What a group with ``fused=None`` and ``foreach=None`` runs (torch would pick by device).
DEFAULT_IMPLEMENTATION = "fused"


def group_implementation(group: Mapping[str, Any]) -> str:
    """``"fused"``, ``"foreach"`` or ``"for-loop"``: the update ``group``'s flags select.

    As ``torch.optim.adam.adam``: ``fused`` wins, then ``foreach``; an explicit False for
    both is the for-loop. Both None: :data:`DEFAULT_IMPLEMENTATION`.
    """
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if fused is None and foreach is None:
        return DEFAULT_IMPLEMENTATION
    return "for-loop"


def pin_default_implementation(group: dict[str, Any]) -> None:
    """A group with neither ``fused`` nor ``foreach`` set gets ``fused=True``: what it runs,
    recorded, so that a checkpoint of it resumes on the same kernel under torch's own
    optimizer (which would pick by device for None/None)."""
    if group.get("fused") is None and group.get("foreach") is None:
        group["fused"] = DEFAULT_IMPLEMENTATION == "fused"


def steps_on_device(group: Mapping[str, Any]) -> bool:
    """Whether torch keeps ``group``'s step counts on the parameter's device (fused or
    capturable) rather than on the CPU."""
    return group_implementation(group) == "fused" or bool(group.get("capturable", False))


def checked_param_and_grad(
    param: torch.Tensor, grad: torch.Tensor, group: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local shards of ``param`` and ``grad``, after the checks torch's fused Adam makes."""
    if grad.is_sparse:
        raise RuntimeError(
            "SwapOptimizersContainer does not support sparse gradients, please consider SparseAdam instead"
        )
    if group.get("differentiable", False):
        raise RuntimeError("SwapOptimizersContainer does not support differentiable=True")
    grad = grad_on_param_placements(param, grad)
    local_param, local_grad = dtensor_utils.unwrap_dtensor(param), dtensor_utils.unwrap_dtensor(grad)
    if group_implementation(group) == "fused":
        _device_dtype_check_for_fused(local_param)
    return local_param, local_grad


class PlacementError(RuntimeError):
    """A gradient that cannot be brought to its parameter's placements; ``param`` is the
    parameter (the step names it)."""

    def __init__(self, message: str, param: torch.Tensor):
        super().__init__(message)
        self.param = param


def grad_on_param_placements(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``param``'s placements. Without FSDP a tensor-parallel gradient can differ
    from its parameter's (a sharded embedding's comes Replicate, a replicated norm's Partial);
    torch's DTensor dispatch of the fused Adam redistributes it to the parameter's placements
    before the local update, and so does this, with the same ``redistribute``, so the local
    shards and the numbers are torch's. PlacementError where torch would fail too."""
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
        param,
    )


def fused_check_passes(local_param: torch.Tensor, group: Mapping[str, Any]) -> bool:
    """Whether ``local_param`` passes torch's device and dtype check for ``group``'s fused
    kernel (True for other implementations), without raising."""
    if group_implementation(group) != "fused":
        return True
    try:
        _device_dtype_check_for_fused(local_param)
    except RuntimeError:
        return False
    return True


def plan_slices(sizes: Sequence[int], times: int) -> list[range]:
    """Split items of the given byte sizes into at most ``times`` contiguous runs.

    Whole items only, balanced by bytes: an item goes to the slice its byte midpoint
    falls in, so each run holds about ``sum(sizes) / times`` bytes and the order of
    the items (the update order) is kept. Empty runs are dropped.
    """
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    total = sum(sizes)
    if not sizes:
        return []
    if total == 0:
        return [range(len(sizes))]
    slices: list[range] = []
    start, current, before = 0, 0, 0
    for index, size in enumerate(sizes):
        # The midpoint's slice, (before + size / 2) * times // total, in integers: exact
        # at any size (a float loses bytes above 2^53).
        target = min(times - 1, (2 * before + size) * times // (2 * total))
        if target != current:
            slices.append(range(start, index))
            start, current = index, target
        before += size
    slices.append(range(start, len(sizes)))
    return [run for run in slices if len(run)]


def fused_adam_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    group: Mapping[str, Any],
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> None:
    """One fused Adam/AdamW update of plain (local) tensors with ``group``'s settings.

    ``max_exp_avg_sqs`` is empty unless ``group["amsgrad"]``. Steps are incremented
    here, before the kernel, exactly as torch does; with ``found_inf`` they are
    decremented again afterwards. ``steps``: a vector whose elements are ``state_steps``, in
    order (or None); where every tensor is of one device and dtype (one kernel call), the
    steps are then incremented by one ``add_`` on it instead of torch's ``_foreach_add_``
    over the scalars (a CPU foreach falls back to one op per tensor): the same float32
    ``+ 1``, so the same bits.
    """
    if not params:
        return
    if group.get("differentiable", False):
        raise RuntimeError("Adam with fused=True does not support differentiable=True")
    beta1, beta2 = (_to_scalar(beta) for beta in group["betas"])
    lr = group["lr"]
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    # As torch: a tensor lr on an accelerator is moved to each device; on CPU it is
    # passed as it is.
    lr_by_device: dict[torch.device, torch.Tensor] | None = (
        {lr.device: lr} if isinstance(lr, torch.Tensor) and str(lr.device) != "cpu" else None
    )
    scale_by_device: dict[torch.device, torch.Tensor] = {}
    inf_by_device: dict[torch.device, torch.Tensor] = {}
    grouped = Optimizer._group_tensors_by_device_and_dtype(
        [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps]  # type: ignore[list-item]
    )
    vector = steps if len(grouped) == 1 else None  # then d_steps is state_steps, in order
    for (device, _), ((d_params, d_grads, d_avgs, d_sqs, d_max, d_steps), _) in grouped.items():
        device_lr: Any = lr if lr_by_device is None else _on_device(lr_by_device, lr, device)
        device_scale = None if grad_scale is None else _on_device(scale_by_device, grad_scale, device)
        device_inf = None if found_inf is None else _on_device(inf_by_device, found_inf, device)
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
    """``+ 1`` (or ``- minus``) on every step, as torch does it over the scalars, or on
    ``vector``, the tensor they are views of: one op, the same float32 arithmetic."""
    if vector is not None:
        vector.add_(1) if minus is None else vector.sub_(minus)
    elif minus is None:
        torch._foreach_add_(steps, 1)
    else:
        torch._foreach_sub_(steps, [minus] * len(steps))


def adam_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    group: Mapping[str, Any],
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
    upcast: bool = False,
) -> None:
    """One Adam/AdamW update of plain (local) tensors with ``group``'s settings and
    implementation (:func:`group_implementation`); steps are incremented here (``steps``:
    the vector ``state_steps`` are views of, see :func:`fused_adam_update`; the foreach and
    for-loop updates are torch's own and ignore it). ``upcast``: moments of a lower precision
    than their CPU parameters (:func:`_upcast_update`)."""
    if not params:
        return
    if upcast:
        moments, update = (exp_avgs, exp_avg_sqs, max_exp_avg_sqs), {"grad_scale": grad_scale, "found_inf": found_inf}
        return _upcast_update(params, grads, moments, state_steps, group=group, steps=steps, **update)
    implementation = group_implementation(group)
    if implementation == "fused":
        fused_adam_update(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
            group=group, grad_scale=grad_scale, found_inf=found_inf, steps=steps,
        )  # fmt: skip
        return
    capturable = bool(group.get("capturable", False))
    if implementation == "foreach" and isinstance(group["lr"], torch.Tensor) and not capturable:
        # Adam._init_group's check, word for word.
        raise RuntimeError("lr as a Tensor is not supported for capturable=False and foreach=True")
    beta1, beta2 = group["betas"]
    torch_functional_adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        foreach=implementation == "foreach",
        capturable=capturable,
        differentiable=bool(group.get("differentiable", False)),
        fused=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
        has_complex=any(torch.is_complex(p) for p in params),
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


def _upcast_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: tuple[list[torch.Tensor], ...],
    state_steps: list[torch.Tensor],
    **update: Any,
) -> None:
    """The update of moments kept in a lower precision than their parameters, on the CPU.

    torch's fused Adam has a mixed-precision kernel on CUDA only (on the CPU: "expected scalar
    type Float but found BFloat16"). That kernel reads the moments into the parameters'
    precision, updates both there and stores the moments rounded; this does the same in three
    steps: the moments upcast (``moments``: exp_avgs, exp_avg_sqs, max_exp_avg_sqs), the update in
    the parameters' dtype (:func:`adam_update`), the new moments rounded back (``copy_``: round to
    nearest even, as the kernel's store)."""
    upcast = [[moment.to(param.dtype) for moment, param in zip(kind, params)] for kind in moments]
    adam_update(params, grads, *upcast, state_steps, **update)
    for kind, wide in zip(moments, upcast):
        for moment, value in zip(kind, wide):
            moment.copy_(value)


def _on_device(
    cache: dict[torch.device, torch.Tensor], tensor: torch.Tensor, device: torch.device
) -> torch.Tensor:
    if device not in cache:
        cache[device] = tensor.to(device=device, non_blocking=True)
    return cache[device]


# -- slices: per-parameter facts planned once, checked per step --------------------
@dataclass(eq=False)
class SliceWork:
    """The parameters of one slice that have a gradient in this step, as parallel lists in
    update order; ``runs``: ``(group, start, end)`` of each param group's consecutive ones."""

    params: list[torch.Tensor]
    local_params: list[torch.Tensor]
    local_grads: list[torch.Tensor]
    host: SliceStates
    runs: list[tuple[dict[str, Any], int, int]]


@dataclass(eq=False)
class SlicePlan:
    """A planned slice and the facts about its parameters that hold until the plan is
    invalidated (:meth:`~swap_state.client.optim.step_pipeline.StepPipeline._plan_for`): each one's param group and host cache
    (None while incomplete). ``full``: the slice's work when every parameter has a gradient
    that passes the per-step checks (gradients, and a DTensor's local shards, which FSDP may
    swap, filled in at each step); None when a parameter needs the per-parameter path (a
    cache to complete, a group torch refuses, a dtype or device the fused kernel does not
    take, plain and DTensor parameters mixed)."""

    params: list[torch.Tensor]
    groups: list[dict[str, Any]]
    hosts: list[HostCache | None]
    full: SliceWork | None
    dtensor: bool


PendingSlice = tuple[SlicePlan, list[int], list[torch.Tensor], list[torch.Tensor]]
"""A slice on the per-parameter path: its plan, the indices with a gradient, their local
parameters and gradients (:func:`checked_slice`)."""


def plan_slice(
    params: list[torch.Tensor], groups: list[dict[str, Any]], caches: Mapping[torch.Tensor, Any]
) -> SlicePlan:
    """The plan of one slice: what :class:`SlicePlan` caches, checked once.

    A host cache counts when it holds every moment its group needs and a step; the fused
    kernel's device and dtype check is made here, as torch makes it once, when it creates a
    parameter's state (a parameter that fails it sends its slice down the per-parameter path,
    which raises torch's error once it has a gradient)."""
    locals_: list[torch.Tensor | None] = []
    hosts: list[HostCache | None] = []
    kinds = set()
    full = True
    for param, group in zip(params, groups, strict=True):
        is_dtensor = isinstance(param, DTensor)
        kinds.add(is_dtensor)
        local = dtensor_utils.unwrap_dtensor(param)
        locals_.append(None if is_dtensor else local)
        host = caches.get(param)
        ready = host_cache_ready(host, group) and host.get(STEP_KEY) is not None  # type: ignore[union-attr]
        hosts.append(host if ready else None)
        full = full and ready and not group.get("differentiable", False) and fused_check_passes(local, group)
    work = None
    if full and len(kinds) == 1:
        work = slice_work(params, groups, [] if True in kinds else locals_, [], hosts)  # type: ignore[arg-type]
    return SlicePlan(params, groups, hosts, work, True in kinds)


def full_slice_work(planned: SlicePlan, grads: list[Any]) -> SliceWork | None:
    """The planned work of a slice, over its parameters that have a gradient, when those
    gradients pass torch's per-step checks (one pass over them each, no per-parameter call);
    else None (the per-parameter path raises torch's error)."""
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
    # A plain parameter's gradient is a plain tensor (``type(g) is Tensor``: not a DTensor), a
    # DTensor's a DTensor with its placements; neither sparse.
    if planned.dtensor:
        if not all(isinstance(grad, DTensor) for grad in present) or any(grad.is_sparse for grad in present):
            return None
        if any(grad.placements != param.placements for param, grad in zip(params, present, strict=True)):
            return None
        unwrap = dtensor_utils.unwrap_dtensor
        local_params, local_grads = [unwrap(p) for p in params], [unwrap(g) for g in present]
    else:
        if not all(type(grad) is torch.Tensor for grad in present) or any(grad.is_sparse for grad in present):
            return None
        local_params = full.local_params if indices is None else [full.local_params[i] for i in indices]
        local_grads = present
    if indices is None:
        return dataclasses.replace(full, local_params=local_params, local_grads=local_grads)
    return _subset(full, indices, local_params, local_grads)


def _subset(
    full: SliceWork, indices: list[int], local_params: list[torch.Tensor], local_grads: list[torch.Tensor]
) -> SliceWork:
    """``full`` restricted to ``indices`` (sorted): their host states, their group runs, and
    the step vector's run when they are consecutive."""
    tensors = {key: [values[i] for i in indices] for key, values in full.host.tensors.items()}
    runs = []
    for group, start, end in full.runs:
        low, high = bisect.bisect_left(indices, start), bisect.bisect_left(indices, end)
        if high > low:
            runs.append((group, low, high))
    steps = full.host.steps
    first = indices[0]
    if steps is not None and indices[-1] - first + 1 == len(indices):
        steps = steps[first : first + len(indices)]
    else:
        steps = None
    params = [full.params[i] for i in indices]
    return SliceWork(params, local_params, local_grads, SliceStates(tensors, steps), runs)


def checked_slice(
    planned: SlicePlan, grads: list[Any]
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """The per-parameter path: the indices of the parameters with a gradient and their
    local shards, after every check torch makes (:func:`checked_param_and_grad`)."""
    indices, local_params, local_grads = [], [], []
    for index, (param, grad) in enumerate(zip(planned.params, grads, strict=True)):
        if grad is None:
            continue  # as torch: no gradient, no update, no step increment
        local_param, local_grad = checked_param_and_grad(param, grad, planned.groups[index])
        indices.append(index)
        local_params.append(local_param)
        local_grads.append(local_grad)
    return indices, local_params, local_grads


def slice_work(
    params: list[torch.Tensor],
    groups: list[dict[str, Any]],
    local_params: list[torch.Tensor],
    local_grads: list[torch.Tensor],
    hosts: list[HostCache],
) -> SliceWork:
    """A slice's work over complete host caches ``hosts`` (parallel lists)."""
    runs: list[tuple[dict[str, Any], int, int]] = []
    for index, group in enumerate(groups):
        if runs and runs[-1][0] is group:
            runs[-1] = (group, runs[-1][1], index + 1)
        else:
            runs.append((group, index, index + 1))
    return SliceWork(params, local_params, local_grads, host_states(hosts), runs)
