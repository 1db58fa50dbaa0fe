"""Step correctness on CPU: 10 steps bitwise equal to torch's own fused Adam / AdamW.

Every case runs both code paths: in place on the host cache (``pipeline=False``, what a
CPU-only process does) and the accelerator pipeline with CPU "device" buffers
(``pipeline=True``: real load copies, slices, events and offload copies).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _swap_testing import ParityModel, assert_matches_reference, swap_and_reference, train

from swap_state.client.swap_optimizer import STEP_KEY

PIPELINES = [pytest.param(False, id="inplace"), pytest.param(True, id="pipelined")]
KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.Adam], ids=["AdamW", "Adam"])
def test_ten_steps_bitwise_equal_to_torch_fused(optimizer_cls: type, amsgrad: bool, pipeline: bool) -> None:
    """Two groups (different lr, decay), tied weights, a param without grad on odd steps."""
    container, model, ref, ref_model = swap_and_reference(
        optimizer_cls, {**KWARGS, "amsgrad": amsgrad}, pipeline=pipeline
    )
    groups = container.optimizers[0].param_groups
    assert len(groups) == 2 and groups[0]["lr"] != groups[1]["lr"]
    train(model, container, range(10))
    train(ref_model, ref, range(10))
    assert_matches_reference(container, model, ref, ref_model)
    host = container.param_to_cpu_states_map
    assert float(host[model.sometimes][STEP_KEY]) == 5.0  # per-param step, not the group's 10
    assert float(groups[0]["step"]) == 10.0
    assert model.head.weight is model.embedding.weight


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_dtensor_parameter_on_gloo_mesh(cpu_mesh: Any, pipeline: bool) -> None:
    container, model, ref, ref_model = swap_and_reference(
        torch.optim.AdamW, {**KWARGS, "amsgrad": True}, mesh=cpu_mesh, pipeline=pipeline
    )
    host = container.param_to_cpu_states_map[model.sharded]
    assert not isinstance(host["exp_avg"], torch.distributed.tensor.DTensor)
    train(model, container, range(10))
    train(ref_model, ref, range(10))
    assert_matches_reference(container, model, ref, ref_model)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_maximize_and_single_group(pipeline: bool) -> None:
    container, model, ref, ref_model = swap_and_reference(
        torch.optim.AdamW, {**KWARGS, "maximize": True}, groups=None, times=1, pipeline=pipeline
    )
    train(model, container, range(10))
    train(ref_model, ref, range(10))
    assert_matches_reference(container, model, ref, ref_model)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_grad_scale_and_found_inf_like_torch(pipeline: bool) -> None:
    """GradScaler's fused path sets ``grad_scale`` / ``found_inf`` on the optimizer."""
    container, model, ref, ref_model = swap_and_reference(torch.optim.AdamW, KWARGS, pipeline=pipeline)
    optim = container.optimizers[0]
    for step in range(6):
        found = torch.tensor(1.0 if step == 3 else 0.0)
        for target in (optim, ref):
            target.grad_scale = torch.tensor(4.0)  # type: ignore[attr-defined]
            target.found_inf = found.clone()  # type: ignore[attr-defined]
        train(model, container, range(step, step + 1))
        train(ref_model, ref, range(step, step + 1))
    assert_matches_reference(container, model, ref, ref_model)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_lr_scheduler_on_inner_optimizer(pipeline: bool) -> None:
    """torchtitan wraps each inner optimizer in an LR scheduler: schedule and tracking work."""
    container, model, ref, ref_model = swap_and_reference(torch.optim.AdamW, KWARGS, pipeline=pipeline)

    def decay(step: int) -> float:
        return 0.5**step

    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in (container.optimizers[0], ref)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(5):
            train(model, container, range(step, step + 1))
            train(ref_model, ref, range(step, step + 1))
            for scheduler in schedulers:
                scheduler.step()
    assert container.optimizers[0].param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_matches_reference(container, model, ref, ref_model)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_param_group_added_later_gets_state_lazily(pipeline: bool) -> None:
    """A group added after construction is allocated at its first step, torch-identically."""

    def without_never(model: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"params": [p for n, p in model.named_parameters() if n != ParityModel.NEVER]}]

    container, model, ref, ref_model = swap_and_reference(
        torch.optim.Adam, KWARGS, groups=without_never, pipeline=pipeline
    )
    train(model, container, range(3))
    train(ref_model, ref, range(3))
    assert model.never not in container.param_to_cpu_states_map
    container.optimizers[0].add_param_group({"params": [model.never], "lr": 0.2})
    ref.add_param_group({"params": [ref_model.never], "lr": 0.2})
    for step in range(3, 8):
        for m, opt in ((model, container), (ref_model, ref)):
            train(m, opt, range(step, step + 1))
            m.never.grad = None
            m.never.grad = torch.full_like(m.never, 0.5 * step)
            opt.step()
    assert model.never in container.param_to_cpu_states_map
    assert_matches_reference(container, model, ref, ref_model)
