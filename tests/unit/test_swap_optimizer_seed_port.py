"""The seed's tests (../shared/seed/), ported: same assertions, our module by its real name."""

from __future__ import annotations

import types
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torchtitan.components.optimizer as tt_optimizer
from _swap_testing import TiedEmbeddingModel
from torch.distributed.tensor import DTensor, Replicate

from swap_state.client import swap_optimizer

Container = swap_optimizer.SwapOptimizersContainer


def _swap_config(name: str, times: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        swap_optimizer=True,
        name=name,
        lr=1e-3,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        implementation="fused",
        swap_optimizer_times=times,
    )


def test_unwrap_dtensor_returns_plain_tensor_for_non_dtensor() -> None:
    tensor = torch.randn(2, 2)
    assert swap_optimizer.unwrap_dtensor(tensor) is tensor


def test_build_optimizers_wrapper_delegates_when_swap_disabled() -> None:
    sentinel = object()
    calls = []

    def original(model_parts: Any, optimizer_config: Any, parallel_dims: Any, ft_manager: Any) -> object:
        calls.append((model_parts, optimizer_config, parallel_dims, ft_manager))
        return sentinel

    with patch.object(swap_optimizer, "_original_build_optimizers", original):
        optimizer_config = types.SimpleNamespace(swap_optimizer=False)
        result = tt_optimizer.build_optimizers(
            model_parts=["model"],
            optimizer_config=optimizer_config,
            parallel_dims="parallel_dims",
            ft_manager="ft_manager",
        )
    assert result is sentinel
    assert calls == [(["model"], optimizer_config, "parallel_dims", "ft_manager")]


def test_build_optimizers_wrapper_rejects_unknown_optimizer() -> None:
    with pytest.raises(NotImplementedError) as exc:
        tt_optimizer.build_optimizers(
            model_parts=[], optimizer_config=_swap_config("SGD", 8), parallel_dims=None, ft_manager=None
        )
    assert "Optimizer SGD not added" in str(exc.value)


def test_build_optimizers_wrapper_uses_swap_container(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(model_parts: Any, optimizer_cls: Any, optimizer_kwargs: Any, swap_times: Any) -> str:
        calls.append((model_parts, optimizer_cls, optimizer_kwargs, swap_times))
        return "swap_container"

    monkeypatch.setattr(swap_optimizer, "SwapOptimizersContainer", fake)
    result = tt_optimizer.build_optimizers(
        model_parts=["model_part"],
        optimizer_config=_swap_config("AdamW", 16),
        parallel_dims=None,
        ft_manager=None,
    )
    assert result == "swap_container"
    assert calls[0][0] == ["model_part"]
    assert calls[0][1] is torch.optim.AdamW
    assert calls[0][2]["lr"] == 1e-3
    assert calls[0][3] == 16


def test_state_dict_uses_cpu_cache_snapshot_and_restores_swap_state(swapped_optimizer: Any) -> None:
    fixture = swapped_optimizer(exp_avg=1.25, exp_avg_sq=2.5, step=5)
    state_dict = fixture.container.state_dict()
    fixture.optimizer.param_groups[0]["step"].add_(1)
    assert torch.equal(state_dict["state.weight.exp_avg"], fixture.cpu_state["exp_avg"])
    assert torch.equal(state_dict["state.weight.exp_avg_sq"], fixture.cpu_state["exp_avg_sq"])
    assert state_dict["state.weight.exp_avg"].device.type == "cpu"
    assert not isinstance(state_dict["state.weight.exp_avg"], DTensor)
    assert "state.weight.max_exp_avg_sq" not in state_dict
    assert state_dict["state.weight.step"].item() == 5
    assert state_dict["param_groups.weight.step"].item() == 5
    assert state_dict["state.weight.step"] is not fixture.optimizer.param_groups[0]["step"]
    assert state_dict["param_groups.weight.step"] is not fixture.optimizer.param_groups[0]["step"]
    state = fixture.optimizer.state[fixture.param]
    assert state["exp_avg"] is fixture.live_exp_avg
    assert state["exp_avg"].untyped_storage().size() == 0
    assert state["exp_avg_sq"] is fixture.live_exp_avg_sq
    assert state["exp_avg_sq"].untyped_storage().size() == 0
    assert state["max_exp_avg_sq"] is None
    assert "step" not in state


def test_state_dict_preserves_dtensor_layout_for_cpu_cache(
    monkeypatch: pytest.MonkeyPatch, cpu_mesh: Any
) -> None:
    local_param = torch.randn(2, 2)
    param = DTensor.from_local(local_param, cpu_mesh, [Replicate()])
    live_exp_avg = DTensor.from_local(torch.zeros_like(local_param), cpu_mesh, [Replicate()])
    cpu_exp_avg = torch.ones_like(local_param, device="cpu")
    monkeypatch.setattr(Container, "param_to_cpu_states_map", {param: {"exp_avg": cpu_exp_avg}})

    def forbid_from_local(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("CPU-cache state_dict must not call DTensor.from_local")

    monkeypatch.setattr(swap_optimizer.DTensor, "from_local", staticmethod(forbid_from_local))
    value = Container._state_value_for_state_dict(param, {"exp_avg": live_exp_avg}, "exp_avg")
    assert isinstance(value, DTensor)
    assert value.device_mesh == param.device_mesh
    assert value.placements == param.placements
    local_value = value.to_local()
    assert local_value.device.type == "cpu"
    assert local_value.untyped_storage().data_ptr() == cpu_exp_avg.untyped_storage().data_ptr()


def test_state_dict_allows_zero_numel_cpu_cache_shard() -> None:
    value = Container._tensor_for_state_dict(torch.empty(0, 16384, device="cpu"))
    assert value.shape == torch.Size([0, 16384])
    assert value.numel() == 0
    assert value.untyped_storage().size() == 0


def test_state_dict_rejects_nonempty_cache_placeholder_without_storage() -> None:
    placeholder = torch.empty(4, 16384, device="cpu")
    placeholder.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="without CPU cache"):
        Container._tensor_for_state_dict(placeholder)


def test_load_state_dict_rebuilds_swap_state_without_mutating_checkpoint(swapped_optimizer: Any) -> None:
    source = swapped_optimizer(exp_avg=3.0, exp_avg_sq=4.0, step=5)
    checkpoint = source.container.state_dict()
    originals = {key: checkpoint[f"state.weight.{key}"].clone() for key in ("exp_avg", "exp_avg_sq")}
    storage_sizes = {key: checkpoint[f"state.weight.{key}"].untyped_storage().size() for key in originals}
    target = swapped_optimizer(exp_avg=0.0, exp_avg_sq=0.0)
    target.container.load_state_dict(checkpoint)
    for key, original in originals.items():
        assert checkpoint[f"state.weight.{key}"].untyped_storage().size() == storage_sizes[key], (
            f"{key} storage mutated"
        )
        assert torch.equal(checkpoint[f"state.weight.{key}"], original), f"{key} checkpoint value mutated"
    assert target.optimizer.param_to_group_map[target.param] is target.optimizer.param_groups[0]
    assert target.optimizer.param_groups[0]["step"].item() == 5
    assert "step" not in target.optimizer.state[target.param]
    assert Container.param_to_device_states_map[target.param] is target.optimizer.state[target.param]
    target_cpu_state = Container.param_to_cpu_states_map[target.param]
    assert torch.equal(target_cpu_state["exp_avg"], originals["exp_avg"])
    assert torch.equal(target_cpu_state["exp_avg_sq"], originals["exp_avg_sq"])
    assert target_cpu_state["max_exp_avg_sq"] is None
    assert target.optimizer.state[target.param]["exp_avg"].untyped_storage().size() == 0
    assert target.optimizer.state[target.param]["exp_avg_sq"].untyped_storage().size() == 0
    assert target.optimizer.state[target.param]["max_exp_avg_sq"] is None


def _to_alias(state_dict: dict[str, Any], canonical: str, alias: str) -> dict[str, Any]:
    renamed = {}
    for key, value in state_dict.items():
        for section in ("state", "param_groups"):
            prefix = f"{section}.{canonical}."
            if key.startswith(prefix):
                key = f"{section}.{alias}." + key[len(prefix) :]
        renamed[key] = value
    return renamed


def test_shared_parameter_aliases_use_canonical_save_and_alias_load(swapped_optimizer: Any) -> None:
    source_model = TiedEmbeddingModel()
    source = swapped_optimizer(
        exp_avg=3.0, exp_avg_sq=4.0, step=5, model=source_model, param=source_model.embedding.weight
    )
    fqns_by_param = Container._fqns_by_param(source_model)
    assert fqns_by_param[source_model.embedding.weight] == ("embedding.weight", "lm_head.weight")
    checkpoint = source.container.state_dict()
    assert "state.embedding.weight.exp_avg" in checkpoint
    assert "state.lm_head.weight.exp_avg" not in checkpoint
    assert "param_groups.embedding.weight.lr" in checkpoint
    assert "param_groups.lm_head.weight.lr" not in checkpoint
    alias_state_dict = _to_alias(checkpoint, "embedding.weight", "lm_head.weight")
    target_model = TiedEmbeddingModel()
    target = swapped_optimizer(
        exp_avg=0.0, exp_avg_sq=0.0, model=target_model, param=target_model.embedding.weight
    )
    target.optimizer.param_groups[0]["lr"] = 0.5
    target.container.load_state_dict(alias_state_dict)
    assert target.optimizer.param_groups[0]["lr"] == 1e-3
    assert target.optimizer.param_groups[0]["step"].item() == 5
    target_cpu_state = Container.param_to_cpu_states_map[target.param]
    assert torch.equal(target_cpu_state["exp_avg"], alias_state_dict["state.lm_head.weight.exp_avg"])
    assert torch.equal(target_cpu_state["exp_avg_sq"], alias_state_dict["state.lm_head.weight.exp_avg_sq"])


def test_load_state_dict_clears_device_cache_after_rebuilding_swap_state(
    swapped_optimizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = swapped_optimizer(exp_avg=3.0, exp_avg_sq=4.0, step=5).container.state_dict()
    target = swapped_optimizer(exp_avg=0.0, exp_avg_sq=0.0)
    calls = []
    device = types.SimpleNamespace(empty_cache=lambda: calls.append("empty_cache"))
    monkeypatch.setattr(swap_optimizer, "get_torch_device", lambda: device)
    target.container.load_state_dict(checkpoint)
    assert calls == ["empty_cache"]


def test_state_dict_builds_flat_dict_without_upstream_optimizer_conversion(
    swapped_optimizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixture = swapped_optimizer(exp_avg=1.0, exp_avg_sq=2.0, step=3)

    def fail_upstream_state_dict(self: Any) -> Any:
        raise AssertionError("upstream state_dict should not be called")

    monkeypatch.setattr(tt_optimizer.OptimizersContainer, "state_dict", fail_upstream_state_dict)
    state_dict = fixture.container.state_dict()
    assert set(state_dict) >= {
        "state.weight.exp_avg",
        "state.weight.exp_avg_sq",
        "state.weight.step",
        "param_groups.weight.lr",
        "param_groups.weight.betas",
        "param_groups.weight.amsgrad",
    }
    assert torch.equal(state_dict["state.weight.exp_avg"], fixture.cpu_state["exp_avg"])
    assert state_dict["state.weight.step"].item() == 3


def test_move_step_to_device_uses_configured_torch_device(monkeypatch: pytest.MonkeyPatch) -> None:
    device = types.SimpleNamespace(current_device=lambda: torch.device("cpu"))
    monkeypatch.setattr(swap_optimizer, "get_torch_device", lambda: device)
    moved_step = Container._move_step_to_device(torch.tensor(5, dtype=torch.int64))
    assert moved_step.device.type == "cpu"
    assert moved_step.item() == 5


def test_loaded_plain_cpu_state_rebuilds_dtensor_runtime_placeholder(cpu_mesh: Any) -> None:
    local_param = torch.randn(2, 2)
    param = DTensor.from_local(local_param, cpu_mesh, [Replicate()])
    placeholder = Container._clone_loaded_state_for_device_placeholder(param, torch.ones_like(local_param))
    assert isinstance(placeholder, DTensor)
    assert placeholder.device_mesh == param.device_mesh
    assert placeholder.placements == param.placements
    assert placeholder.to_local().untyped_storage().size() == 0


def test_loaded_cpu_state_for_non_cpu_param_keeps_plain_zero_storage_placeholder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    param = types.SimpleNamespace(device=torch.device("meta"))
    wrap_calls = []

    def forbid_wrap(local_tensor: Any, like_tensor: Any) -> Any:
        wrap_calls.append(True)
        return local_tensor

    monkeypatch.setattr(swap_optimizer, "wrap_like_param", forbid_wrap)
    placeholder = Container._clone_loaded_state_for_device_placeholder(param, torch.ones(2, 2, device="cpu"))
    assert placeholder.device.type == "cpu"
    assert placeholder.untyped_storage().size() == 0
    assert wrap_calls == []
