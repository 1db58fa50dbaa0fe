"""The pipelined step on a fake asynchronous device (copies complete only when waited for):
its device memory stays bounded, its results stay bitwise torch's, and a failing update
leaves no copy in flight.

The fake (:mod:`fake_async_device`) is the slowest device possible: a side stream runs
nothing until the host waits for it, so whatever the host does not wait for stays queued
and its buffers stay allocated, as they would on a real device that lags the host.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from _swap_testing import apply_grads, assert_bitwise_equal, make_grads
from fake_async_device import AsyncFakeBackend

from swap_state.client.swap_optimizer import STEP_KEY, SwapOptimizersContainer

N_SLICES = 10
WIDTH = 16
MOMENT_BYTES = WIDTH * WIDTH * 4
IMPLEMENTATIONS = [
    pytest.param({}, id="fused"),  # torch's default here; the step count lives on the device
    pytest.param({"fused": False, "foreach": False}, id="for-loop"),  # the step stays on the CPU
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(N_SLICES)])


def _container(model: nn.Module, backend: AsyncFakeBackend, kwargs: dict[str, Any]) -> SwapOptimizersContainer:
    # One parameter per slice: N_SLICES slices of equal size.
    return SwapOptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-2, **kwargs}, N_SLICES, device_backend=backend, pipeline=True
    )


@pytest.mark.parametrize("kwargs", IMPLEMENTATIONS)
def test_device_memory_stays_two_slices_and_results_stay_bitwise(kwargs: dict[str, Any]) -> None:
    model = _model()
    ref_model = copy.deepcopy(model)
    backend = AsyncFakeBackend()
    container = _container(model, backend, kwargs)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, **({"fused": True} | kwargs))
    slice_bytes = 2 * MOMENT_BYTES + (4 if not kwargs else 0)  # exp_avg, exp_avg_sq (+ step)
    for step in range(3):
        for target in (model, ref_model):
            apply_grads(target, make_grads(target, step))
        container.step()
        ref.step()
        # The bound: the slice updating and the slice loading; every earlier slice's
        # buffers are released once its offload is done, before the next load starts.
        assert backend.peak_bytes <= 2 * slice_bytes, (
            f"step {step}: {backend.peak_bytes} device bytes held at once, "
            f"{backend.peak_bytes / slice_bytes:.1f} slices of {N_SLICES}"
        )
        assert backend.peak_bytes >= slice_bytes  # the fake did see the buffers
        assert backend.pending() == 0 and backend.live_bytes == 0  # nothing in flight after a step
    ref_params = dict(ref_model.named_parameters())
    for name, param in model.named_parameters():
        assert_bitwise_equal(param, ref_params[name], name)
        host, ref_state = container.param_to_cpu_states_map[param], ref.state[ref_params[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(host[key], ref_state[key], f"{key} of {name}")
        assert_bitwise_equal(host[STEP_KEY], ref_state["step"], f"step of {name}")


def test_a_failing_update_leaves_no_copy_in_flight() -> None:
    model = _model()
    backend = AsyncFakeBackend()
    container = _container(model, backend, {})
    apply_grads(model, make_grads(model, 0))
    pipeline = container._steps
    update = pipeline._fused_update
    calls = []

    def update_failing_at_slice_4(optim: Any, items: Any, states: Any) -> None:
        calls.append(len(calls))
        if len(calls) == 5:
            # Slices 0-3 are offloading (or offloaded) and slice 5 is loading now.
            assert backend.pending() > 0
            raise RuntimeError("update of slice 4 failed")
        update(optim, items, states)

    pipeline._fused_update = update_failing_at_slice_4  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="slice 4 failed"):
        container.step()
    assert backend.pending() == 0, f"copies still queued when step() raised: {backend.streams}"
    # The slices updated before the failure reached the host cache.
    for index, param in enumerate(model.parameters()):
        written = bool(container.param_to_cpu_states_map[param]["exp_avg"].any())
        assert written == (index < 4), index
