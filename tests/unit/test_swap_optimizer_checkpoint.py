"""Checkpoint round trips (bitwise against uninterrupted torch AdamW) and failing loads."""

from __future__ import annotations

import copy
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _swap_testing import (
    ParityModel,
    assert_matches_reference,
    assert_unchanged,
    container_snapshot,
    reference_optimizer,
    swap_and_reference,
    train,
    two_groups,
)
from torchtitan.components.optimizer import OptimizersContainer

from swap_state.client.optim import host_cache
from swap_state.client.optim.state_loading import StateLoader
from swap_state.client.swap_optimizer import SwapOptimizersContainer
from swap_state.client.device import DeviceBackend
from swap_state.client.optim.moment_store import PinnedHostMemory

KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
PIPELINES = [pytest.param(False, id="inplace"), pytest.param(True, id="pipelined")]


def _resume(
    model: torch.nn.Module, state_dict: dict[str, Any], kwargs: dict[str, Any], pipeline: bool
) -> tuple[Any, Any]:
    """A fresh model with ``model``'s weights and a fresh container loaded from ``state_dict``."""
    fresh = copy.deepcopy(model)
    container = SwapOptimizersContainer(
        [fresh], torch.optim.AdamW, dict(kwargs), 3, param_groups=two_groups, pipeline=pipeline
    )
    container.load_state_dict(state_dict)
    return container, fresh


def _reference_ten_steps(kwargs: dict[str, Any]) -> tuple[Any, Any]:
    _, _, ref, ref_model = swap_and_reference(torch.optim.AdamW, kwargs)
    train(ref_model, ref, range(10))
    return ref, ref_model


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
def test_five_steps_save_load_five_steps_equals_ten(amsgrad: bool, pipeline: bool) -> None:
    kwargs = {**KWARGS, "amsgrad": amsgrad}
    container, model, _, _ = swap_and_reference(torch.optim.AdamW, kwargs, pipeline=pipeline)
    train(model, container, range(5))
    buffer = io.BytesIO()
    torch.save(container.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    resumed, fresh = _resume(model, loaded, kwargs, pipeline)
    train(fresh, resumed, range(5, 10))
    ref, ref_model = _reference_ten_steps(kwargs)
    assert_matches_reference(resumed, fresh, ref, ref_model)


def test_dcp_round_trip_through_state_dict_template(tmp_path: Path) -> None:
    """torchtitan's path: DCP saves state_dict(), loads into a fresh state_dict(), then load."""
    container, model, _, _ = swap_and_reference(torch.optim.AdamW, KWARGS)
    train(model, container, range(5))
    dcp.save(container.state_dict(), checkpoint_id=str(tmp_path))
    fresh = copy.deepcopy(model)
    resumed = SwapOptimizersContainer([fresh], torch.optim.AdamW, dict(KWARGS), 3, param_groups=two_groups)
    template = resumed.state_dict()
    dcp.load(template, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(template)
    train(fresh, resumed, range(5, 10))
    ref, ref_model = _reference_ten_steps(KWARGS)
    assert_matches_reference(resumed, fresh, ref, ref_model)


def test_loads_torchtitan_default_container_checkpoint() -> None:
    """A checkpoint of torchtitan's own container (params never stepped have no state)."""
    torch.manual_seed(0)
    model = ParityModel()
    ref_model = copy.deepcopy(model)
    plain = OptimizersContainer([model], torch.optim.AdamW, {**KWARGS, "fused": True})
    train(model, plain, range(5))
    resumed, fresh = _resume(model, plain.state_dict(), KWARGS, pipeline=False)
    assert not any(k.startswith(f"state.{ParityModel.NEVER}.") for k in plain.state_dict())
    train(fresh, resumed, range(5, 10))
    ref = reference_optimizer(ref_model, torch.optim.AdamW, KWARGS, None)
    train(ref_model, ref, range(10))
    # the checkpoint had one group: both resumed groups took its hyperparameters
    assert all(
        g["lr"] == KWARGS["lr"] and g["weight_decay"] == 0.1 for g in resumed.optimizers[0].param_groups
    )
    assert_matches_reference(resumed, fresh, ref, ref_model)


def test_state_dict_after_steps_carries_per_param_step_and_group_values() -> None:
    container, model, _, _ = swap_and_reference(torch.optim.AdamW, KWARGS)
    train(model, container, range(4))
    state_dict = container.state_dict()
    assert state_dict[f"state.{ParityModel.SOMETIMES}.step"].item() == 2
    assert state_dict["state.proj.weight.step"].item() == 4
    assert state_dict["param_groups.proj.weight.step"].item() == 4
    assert state_dict[f"param_groups.{ParityModel.SOMETIMES}.lr"] == 5e-2
    assert "state.head.weight.exp_avg" not in state_dict  # tied: saved under embedding.weight
    host = container.param_to_cpu_states_map[model.proj.weight]
    assert state_dict["state.proj.weight.exp_avg"].data_ptr() == host["exp_avg"].data_ptr()


def _trained(steps: int = 3) -> tuple[SwapOptimizersContainer, torch.nn.Module, dict[str, Any]]:
    container, model, _, _ = swap_and_reference(torch.optim.AdamW, KWARGS)
    train(model, container, range(steps))
    checkpoint = {
        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in container.state_dict().items()
    }
    return container, model, checkpoint


def _target() -> SwapOptimizersContainer:
    container, model, _, _ = swap_and_reference(torch.optim.AdamW, KWARGS, seed=1)
    train(model, container, range(2), seed=7)
    return container


def _broken(checkpoint: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    broken = dict(checkpoint)
    # change every group's lr too: a load that applied anything before failing would show
    for k in broken:
        if k.endswith(".lr"):
            broken[k] = 0.123
    if value is None:
        del broken[key]
    else:
        broken[key] = value
    return broken


@pytest.mark.parametrize(
    ("key", "make_value", "error", "message"),
    [
        ("state.never.exp_avg_sq", None, KeyError, "state.never.exp_avg_sq"),
        ("state.never.exp_avg", lambda v: v[:1], ValueError, "state.never.exp_avg': shape"),
        ("state.never.exp_avg", lambda v: v.double(), ValueError, "state.never.exp_avg': dtype"),
        ("state.never.exp_avg", lambda v: v.tolist(), TypeError, "state.never.exp_avg': expected a tensor"),
        ("state.never.step", lambda v: torch.ones(3), ValueError, "state.never.step"),
        ("param_groups.never.amsgrad", lambda v: True, ValueError, "param_groups.never.amsgrad"),
    ],
)
def test_failing_load_leaves_container_exactly_as_before(
    key: str, make_value: Any, error: type, message: str
) -> None:
    _, _, checkpoint = _trained()
    target = _target()
    assert key in checkpoint  # "never" is the last parameter loaded
    broken = _broken(checkpoint, key, None if make_value is None else make_value(checkpoint[key]))
    before = container_snapshot(target)
    with pytest.raises(error, match=message.replace(".", r"\.").replace("(", r"\(")):
        target.load_state_dict(broken)
    assert_unchanged(target, before)
    assert all(g["lr"] != 0.123 for g in target.optimizers[0].param_groups)


def test_unknown_parameter_names_the_key() -> None:
    _, _, checkpoint = _trained()
    target = _target()
    renamed = {k.replace(".never.", ".other."): v for k, v in checkpoint.items()}
    before = container_snapshot(target)
    with pytest.raises(KeyError, match=r"state\.never\.exp_avg"):
        target.load_state_dict(renamed)
    assert_unchanged(target, before)


def test_failure_while_preparing_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, checkpoint = _trained()
    target = _target()
    calls = iter(range(100))
    original = host_cache.placeholder_like  # what the state loader's placeholders call

    def flaky(param: Any, tensor: torch.Tensor) -> Any:
        if next(calls) == 5:
            raise MemoryError("placeholder allocation failed")
        return original(param, tensor)

    monkeypatch.setattr(host_cache, "placeholder_like", flaky)
    before = container_snapshot(target)
    with pytest.raises(MemoryError):
        target.load_state_dict(checkpoint)
    assert_unchanged(target, before)


def test_failure_while_committing_restores_every_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime error mid-commit (not expected after validation) restores the dict-level state."""
    _, _, checkpoint = _trained()
    target = _target()
    original = StateLoader._commit_param_load
    calls = iter(range(100))

    def flaky(self: SwapOptimizersContainer, load: Any) -> None:
        if next(calls) == 3:
            raise RuntimeError("copy failed")
        original(self, load)

    monkeypatch.setattr(StateLoader, "_commit_param_load", flaky)
    before = container_snapshot(target)
    for host in before["hosts"].values():  # bytes already copied are not restored
        for name, (tensor, _) in host.items():
            host[name] = (tensor, None)
    with pytest.raises(RuntimeError, match="copy failed"):
        target.load_state_dict(checkpoint)
    assert_unchanged(target, before)


def test_load_hooks_and_single_empty_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, checkpoint = _trained()
    events: list[Any] = []
    snapshot: dict[torch.Tensor, torch.Tensor] = {}

    class Recording(PinnedHostMemory):
        def before_write(self, params: Sequence[torch.Tensor]) -> None:
            if not snapshot:
                return  # training before the load
            unchanged = all(torch.equal(target.param_to_cpu_states_map[p]["exp_avg"], snapshot[p]) for p in params)
            events.append(("before_host_write", len(params), unchanged))

        def after_load(self) -> None:
            events.append(("after_load",))

    backend = DeviceBackend("cpu")
    target, model, _, _ = swap_and_reference(torch.optim.AdamW, KWARGS, seed=1, device_backend=backend,
                                             store=Recording(backend))
    train(model, target, range(1), seed=7)
    snapshot.update({p: target.param_to_cpu_states_map[p]["exp_avg"].clone() for p in model.parameters()})
    monkeypatch.setattr(backend, "empty_cache", lambda: events.append(("empty_cache",)))
    hosts_before = {p: dict(h) for p, h in target.param_to_cpu_states_map.items()}
    target.load_state_dict(checkpoint)
    n_params = len(list(model.parameters()))
    assert events == [("before_host_write", n_params, True), ("empty_cache",), ("after_load",)]
    for param, host in target.param_to_cpu_states_map.items():  # copied in place, never replaced
        assert all(host[k] is hosts_before[param][k] for k in host)
