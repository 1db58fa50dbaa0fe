"""Pure helpers of the swap optimizer: slice planning and the Adam/AdamW update calls.

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

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as torch_functional_adam
from torch.optim.optimizer import _to_scalar

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "adam_update",
    "fused_adam_update",
    "group_implementation",
    "pin_default_implementation",
    "plan_slices",
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
) -> None:
    """One fused Adam/AdamW update of plain (local) tensors with ``group``'s settings.

    ``max_exp_avg_sqs`` is empty unless ``group["amsgrad"]``. Steps are incremented
    here, before the kernel, exactly as torch does; with ``found_inf`` they are
    decremented again afterwards.
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
    for (device, _), ((d_params, d_grads, d_avgs, d_sqs, d_max, d_steps), _) in grouped.items():
        device_lr: Any = lr if lr_by_device is None else _on_device(lr_by_device, lr, device)
        device_scale = None if grad_scale is None else _on_device(scale_by_device, grad_scale, device)
        device_inf = None if found_inf is None else _on_device(inf_by_device, found_inf, device)
        torch._foreach_add_(d_steps, 1)
        kernel(
            d_params,
            d_grads,
            d_avgs,
            d_sqs,
            d_max,
            d_steps,
            amsgrad=group["amsgrad"],
            lr=device_lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=device_scale,
            found_inf=device_inf,
        )
        if device_inf is not None:
            torch._foreach_sub_(d_steps, [device_inf] * len(d_steps))


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
) -> None:
    """One Adam/AdamW update of plain (local) tensors with ``group``'s settings and
    implementation (:func:`group_implementation`); steps are incremented here."""
    if not params:
        return
    implementation = group_implementation(group)
    if implementation == "fused":
        fused_adam_update(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
            group=group, grad_scale=grad_scale, found_inf=found_inf,
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


def _on_device(
    cache: dict[torch.device, torch.Tensor], tensor: torch.Tensor, device: torch.device
) -> torch.Tensor:
    if device not in cache:
        cache[device] = tensor.to(device=device, non_blocking=True)
    return cache[device]
