"""The step's per-parameter plan (StepPipeline._plan_for, kernels.plan_slice): kept while
nothing it caches can change, rebuilt when something could; torch's per-step checks still made
at every step; the steps of a slice as one vector, bitwise as torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _swap_testing import (
    apply_grads,
    assert_matches_reference,
    make_grads,
    swap_and_reference,
    train,
)

from swap_state.client.optim.host_cache import SliceStates, steps_vector
from swap_state.client.optim.kernels import SliceWork, full_slice_work, plan_slice
from swap_state.client.swap_optimizer import STEP_KEY, SwapOptimizersContainer

KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _plans(container: SwapOptimizersContainer) -> list[Any]:
    return container._steps._plans[id(container.optimizers[0])][1]


def _linear_container(times: int = 2) -> tuple[SwapOptimizersContainer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    return SwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), times, pipeline=False), model


def _grads(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def test_the_plan_is_kept_across_steps_and_rebuilt_when_it_could_change() -> None:
    container, model = _linear_container()
    _grads(model, 0)
    container.step()
    plan = _plans(container)
    _grads(model, 1)  # new gradient tensors: nothing planned changes
    container.step()
    assert _plans(container) is plan
    assert all(p.full is not None for p in plan)
    assert all(p.full.host.steps is not None for p in plan)  # the CPU cache's step vector

    container.load_state_dict(container.state_dict())  # caches may be refilled or new
    container.step()
    assert _plans(container) is not plan
    plan = _plans(container)

    group = container.optimizers[0].param_groups[0]
    group["fused"], group["foreach"] = False, True  # the implementation: checks differ
    container.step()
    assert _plans(container) is not plan


def test_a_parameter_replaced_in_its_group_is_planned_anew() -> None:
    container, model = _linear_container()
    _grads(model, 0)
    container.step()
    group = container.optimizers[0].param_groups[0]
    replacement = nn.Parameter(torch.randn(4, 4))
    model[0].weight = replacement
    group["params"][0] = replacement
    replacement.grad = torch.ones(4, 4)
    # A parameter without a cache is given one lazily, as before the plan existed.
    container.step()
    assert replacement in container.param_to_cpu_states_map
    assert float(container.param_to_cpu_states_map[replacement][STEP_KEY]) == 1.0  # a fresh state: its first step


def test_per_step_checks_are_made_with_a_plan_in_place(cpu_mesh: Any) -> None:
    container, model = _linear_container()
    _grads(model, 0)
    container.step()
    before = [p.detach().clone() for p in model.parameters()]
    _grads(model, 1)
    model[2].bias.grad = model[2].bias.grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        container.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert float(container.optimizers[0].param_groups[0]["step"]) == 1.0

    # A DTensor parameter's gradient must be a DTensor with its placements, at every step.
    container, model, _, _ = swap_and_reference(torch.optim.AdamW, KWARGS, mesh=cpu_mesh)
    train(model, container, range(1))
    apply_grads(model, make_grads(model, 1))
    model.sharded.grad = model.sharded.grad.to_local()
    with pytest.raises(RuntimeError, match="placements"):
        container.step()


def test_a_complex_parameter_fails_torchs_fused_check_when_it_has_a_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    model.register_parameter("z", nn.Parameter(torch.randn(3, dtype=torch.complex64)))
    container = SwapOptimizersContainer([model], torch.optim.AdamW, {**KWARGS, "fused": True}, 1, pipeline=False)
    model.weight.grad, model.bias.grad = torch.ones(3, 3), torch.ones(3)
    container.step()  # no gradient for ``z``: torch makes no state for it, nor checks it
    model.z.grad = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="floating point"):
        container.step()


@pytest.mark.parametrize("pipeline", [False, True], ids=["inplace", "pipelined"])
def test_parameters_without_gradients_use_the_plan_and_stay_bitwise(pipeline: bool) -> None:
    """ParityModel: ``sometimes`` lacks a gradient on odd steps, ``never`` always: their
    slices take the planned subset; with found_inf too (the vector decremented)."""
    container, model, ref, ref_model = swap_and_reference(
        torch.optim.AdamW, {**KWARGS, "amsgrad": True}, pipeline=pipeline, times=2
    )
    train(model, container, range(4))
    train(ref_model, ref, range(4))
    found_inf = torch.tensor(1.0)
    for optimizer in (container.optimizers[0], ref):
        optimizer.grad_scale, optimizer.found_inf = torch.tensor(2.0), found_inf  # type: ignore[attr-defined]
    for target, optimizer in ((model, container), (ref_model, ref)):
        apply_grads(target, make_grads(target, 5))
        optimizer.step()
    assert_matches_reference(container, model, ref, ref_model)


def test_a_subset_keeps_the_step_vector_only_when_consecutive() -> None:
    params = [nn.Parameter(torch.randn(2)) for _ in range(4)]
    group = {"params": params, "amsgrad": False, "fused": True}
    steps = torch.zeros(4)
    caches = {p: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2), "max_exp_avg_sq": None,
                  STEP_KEY: steps[i]} for i, p in enumerate(params)}  # fmt: skip
    planned = plan_slice(params, [group] * 4, caches)
    assert isinstance(planned.full, SliceWork) and planned.full.host.steps is not None
    grads = [torch.ones(2), None, torch.ones(2), torch.ones(2)]
    work = full_slice_work(planned, grads)
    assert work is not None and work.params == [params[0], params[2], params[3]]
    assert work.host.steps is None and work.runs == [(group, 0, 3)]
    work = full_slice_work(planned, [None, torch.ones(2), torch.ones(2), None])
    assert work is not None and work.host.steps.data_ptr() == steps[1].data_ptr()
    assert work.host.steps.numel() == 2
    assert isinstance(work.host, SliceStates)
    assert steps_vector([steps[0], steps[2]]) is None and steps_vector([steps[2], steps[3]]) is not None
