"""torchtitan's ``optimizer.implementation``: "fused", "foreach" and "for-loop" each run as
torch runs them, bit for bit (parameters, moments, steps), in place and pipelined; anything
else is refused naming the supported ones."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
import torchtitan.components.optimizer as tt_optimizer
from _swap_testing import ParityModel, assert_matches_reference, train, two_groups

from swap_state.client.optim.kernels import IMPLEMENTATIONS, group_implementation, steps_on_device
from swap_state.client.swap_optimizer import STEP_KEY, SwapOptimizersContainer

pytestmark = pytest.mark.timeout(60)

KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
#: What torchtitan's build_optimizers passes for each implementation.
FLAGS = {
    "fused": {"fused": True, "foreach": False},
    "foreach": {"fused": False, "foreach": True},
    "for-loop": {"fused": False, "foreach": False},
}


@pytest.mark.parametrize("pipeline", [False, True], ids=["inplace", "pipelined"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.Adam], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_each_implementation_is_bitwise_torchs(
    implementation: str, optimizer_cls: type, amsgrad: bool, pipeline: bool
) -> None:
    kwargs = {**KWARGS, "amsgrad": amsgrad, **FLAGS[implementation]}
    torch.manual_seed(0)
    model = ParityModel()
    ref_model = copy.deepcopy(model)
    container = SwapOptimizersContainer(
        [model], optimizer_cls, dict(kwargs), 3, param_groups=two_groups, pipeline=pipeline
    )
    ref = optimizer_cls(two_groups(ref_model), **kwargs)
    train(model, container, range(6))
    train(ref_model, ref, range(6))
    assert_matches_reference(container, model, ref, ref_model)
    for group in container.optimizers[0].param_groups:
        assert group_implementation(group) == implementation
    # torch keeps steps on the CPU without fused/capturable; so does the host cache
    host_step = container.param_to_cpu_states_map[model.proj.weight][STEP_KEY]
    assert host_step.device.type == "cpu" and float(host_step) == 6.0


def test_implementations_really_differ() -> None:
    """The three are not the same kernel under three names: fused and for-loop differ in the
    last bits on this workload (otherwise the test above would prove nothing)."""
    results = {}
    for implementation in ("fused", "for-loop"):
        torch.manual_seed(0)
        model = ParityModel()
        ref = torch.optim.AdamW(two_groups(model), **KWARGS, **FLAGS[implementation])
        train(model, ref, range(6))
        results[implementation] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.equal(results["fused"], results["for-loop"])


def test_group_implementation_follows_torchs_flags() -> None:
    assert group_implementation({"fused": True, "foreach": False}) == "fused"
    assert group_implementation({"fused": None, "foreach": True}) == "foreach"
    assert group_implementation({"fused": False, "foreach": None}) == "for-loop"
    assert group_implementation({"fused": None, "foreach": None}) == "fused"  # documented default
    assert not steps_on_device({"fused": False, "foreach": True, "capturable": False})
    assert steps_on_device({"fused": False, "foreach": True, "capturable": True})


def _config(**overrides: Any) -> types.SimpleNamespace:
    values = dict(
        swap_optimizer=True, name="AdamW", lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
        weight_decay=0.1, implementation="fused", swap_optimizer_times=2,
    )  # fmt: skip
    values.update(overrides)
    return types.SimpleNamespace(**values)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_wrapper_passes_the_implementation(implementation: str) -> None:
    container = tt_optimizer.build_optimizers(
        [torch.nn.Linear(2, 2)], _config(implementation=implementation), None, None
    )
    assert isinstance(container, SwapOptimizersContainer)
    assert group_implementation(container.optimizers[0].param_groups[0]) == implementation


def test_wrapper_refuses_an_unknown_implementation() -> None:
    with pytest.raises(ValueError, match=r"optimizer\.implementation.*'fused', 'foreach', 'for-loop'.*'apex'"):
        tt_optimizer.build_optimizers([torch.nn.Linear(2, 2)], _config(implementation="apex"), None, None)
