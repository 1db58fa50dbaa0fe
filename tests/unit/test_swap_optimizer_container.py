"""Construction, isolation from the rest of the process, hooks, errors and the wrapper."""

from __future__ import annotations

import copy
import types
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn
import torchtitan.components.optimizer as tt_optimizer
from _swap_testing import (
    ParityModel,
    apply_grads,
    assert_matches_reference,
    make_grads,
    swap_and_reference,
    train,
)
from torchtitan.config import Optimizer as OptimizerConfig

from swap_state.client import swap_optimizer
from swap_state.client.device import DeviceBackend
from swap_state.client.optim.moment_store import PinnedHostMemory
from swap_state.client.swap_optimizer import (
    STEP_DTYPE,
    STEP_KEY,
    HostCacheEntry,
    SwapOptimizersContainer,
)

KWARGS = {"lr": 1e-2, "weight_decay": 0.1}


def _container(**kwargs: Any) -> tuple[SwapOptimizersContainer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return SwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2, **kwargs), model


def test_state_maps_are_per_instance() -> None:
    class_cpu = SwapOptimizersContainer.__dict__["param_to_cpu_states_map"]
    class_device = SwapOptimizersContainer.__dict__["param_to_device_states_map"]
    class_cpu_before, class_device_before = dict(class_cpu), dict(class_device)
    first, first_model = _container()
    second, second_model = _container()
    assert first.param_to_cpu_states_map is not second.param_to_cpu_states_map
    assert first.param_to_cpu_states_map is not class_cpu
    assert set(first.param_to_cpu_states_map) == set(first_model.parameters())
    assert set(second.param_to_device_states_map) == set(second_model.parameters())
    assert class_cpu == class_cpu_before and class_device == class_device_before
    # the seed's helper, called on the class, reads the class's map (a built container's are its own)
    param = next(first_model.parameters())
    with pytest.raises(RuntimeError, match="without CPU cache"):
        SwapOptimizersContainer._state_value_for_state_dict(
            param, first.optimizers[0].state[param], "exp_avg"
        )


def test_torch_adamw_is_left_alone() -> None:
    adamw_step = torch.optim.AdamW.__dict__["step"]
    adam_step = torch.optim.Adam.__dict__["step"]
    container, model = _container()
    apply_grads(model, {n: torch.ones_like(p) for n, p in model.named_parameters()})
    container.step()
    assert torch.optim.AdamW.__dict__["step"] is adamw_step
    assert torch.optim.Adam.__dict__["step"] is adam_step
    assert "step" in container.optimizers[0].__dict__  # bound per instance
    # an unrelated AdamW is torch's own: real state tensors, torch's results
    torch.manual_seed(1)
    other = nn.Linear(3, 3)
    twin = copy.deepcopy(other)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (other, twin)]
    for m, optim in zip((other, twin), optims, strict=True):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.3)
        optim.step()
    assert torch.equal(other.weight, twin.weight)
    state = optims[0].state[other.weight]
    assert state["exp_avg"].untyped_storage().size() > 0 and "step" in state


def test_optimizer_state_holds_only_placeholders() -> None:
    container, model = _container()
    train_grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    for _ in range(2):
        apply_grads(model, train_grads)
        container.step()
    for param in model.parameters():
        state = container.optimizers[0].state[param]
        assert state is container.param_to_device_states_map[param]
        assert state["exp_avg"].untyped_storage().size() == 0
        assert state["exp_avg_sq"].untyped_storage().size() == 0
        assert state["max_exp_avg_sq"] is None and "step" not in state
        host = container.param_to_cpu_states_map[param]
        assert not host["exp_avg"].is_pinned()  # no accelerator here: nothing to pin
        assert host[STEP_KEY].dtype == STEP_DTYPE and float(host[STEP_KEY]) == 2


def test_container_step_hooks_run_once_per_step() -> None:
    container, model = _container()
    calls: list[str] = []
    container.register_step_pre_hook(lambda *args: calls.append("pre"))
    container.register_step_post_hook(lambda *args: calls.append("post"))
    apply_grads(model, {n: torch.ones_like(p) for n, p in model.named_parameters()})
    container.step()
    assert calls == ["pre", "post"]


def test_closure_runs_with_grad_enabled() -> None:
    container, model = _container()
    x = torch.randn(5, 3)

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        container.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    loss = container.optimizers[0].step(closure)
    assert isinstance(loss, torch.Tensor)
    assert float(container.param_to_cpu_states_map[model[0].weight][STEP_KEY]) == 1


def test_jit_scripting_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    container, model = _container()
    apply_grads(model, {n: torch.ones_like(p) for n, p in model.named_parameters()})
    monkeypatch.setattr(torch.jit, "is_scripting", lambda: True)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script"):
        container.step()


def test_dtensor_grad_layout_mismatch_is_rejected(cpu_mesh: Any) -> None:
    torch.manual_seed(0)
    model = ParityModel(cpu_mesh)
    container = SwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2)
    apply_grads(model, make_grads(model, 0))
    model.sharded.grad = model.sharded.grad.to_local().clone()  # plain grad for a DTensor param
    with pytest.raises(RuntimeError, match="placements"):
        container.step()


@pytest.mark.parametrize("grad_placement", ["replicate", "partial"])
def test_a_tensor_parallel_gradient_is_brought_to_its_parameters_placements_as_torch_does(
        cpu_mesh: Any, grad_placement: str) -> None:
    """TP without FSDP: a sharded parameter's gradient may come Replicate (an embedding) or
    Partial (a norm); torch's fused AdamW redistributes it, and so does the container."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    placement = Replicate() if grad_placement == "replicate" else Partial()
    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    models = []
    for _ in range(2):
        model = nn.Module()
        model.w = nn.Parameter(DTensor.from_local(weight.clone(), cpu_mesh, [Shard(0)], run_check=False))
        models.append(model)
    container = SwapOptimizersContainer([models[0]], torch.optim.AdamW, dict(KWARGS), 2)
    reference = torch.optim.AdamW(models[1].parameters(), **KWARGS, fused=True)
    for step in range(3):
        grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(step + 1))
        for model in models:
            model.w.grad = DTensor.from_local(grad.clone(), cpu_mesh, [placement], run_check=False)
        container.step()
        reference.step()
    swap_param, ref_param = models[0].w, models[1].w
    assert torch.equal(swap_param.to_local(), ref_param.to_local())
    host = container.param_to_cpu_states_map[swap_param]
    for key in ("exp_avg", "exp_avg_sq"):
        local = host[key].to_local() if isinstance(host[key], DTensor) else host[key]
        assert torch.equal(local, reference.state[ref_param][key].to_local()), key

    models[0].w.grad = torch.ones(8, 4)  # a plain gradient for a DTensor parameter: torch fails too
    with pytest.raises(RuntimeError, match=r"parameter w: the gradient has no placements.*Shard\(dim=0\)"):
        container.step()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.optim.SGD, {"lr": 0.1}, 4), NotImplementedError, "Optimizer SGD not added."),
        ((torch.optim.AdamW, {"lr": 0.1}, 0), ValueError, "swap_optimizer_times"),
    ],
)
def test_constructor_rejects(args: tuple[Any, ...], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SwapOptimizersContainer([nn.Linear(2, 2)], *args)


def test_non_contiguous_parameter_is_rejected() -> None:
    model = nn.Linear(3, 4)
    model.weight = nn.Parameter(torch.randn(3, 4).t())
    with pytest.raises(ValueError, match="'weight' is not contiguous"):
        SwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2)


class FlatArenaStore(PinnedHostMemory):
    """Host cache carved from one flat buffer, as a shared-memory segment would be."""

    def __init__(self) -> None:
        super().__init__(DeviceBackend("cpu"))

    def allocate(self, entries: Sequence[HostCacheEntry], optimizers: Any) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        self.entries = list(entries)
        total = sum(len(e.keys) * e.shape.numel() + 1 for e in entries)
        self.arena = torch.zeros(total, dtype=torch.float32)
        cache, offset = {}, 0
        for entry in entries:
            tensors = {}
            for key in entry.keys:
                n = entry.shape.numel()
                tensors[key] = self.arena[offset : offset + n].view(entry.shape)
                offset += n
            tensors[STEP_KEY] = self.arena[offset]
            offset += 1
            cache[entry.param] = tensors
        return cache


@pytest.mark.parametrize("pipeline", [False, True], ids=["inplace", "pipelined"])
def test_a_stores_host_cache_is_used_in_place(pipeline: bool) -> None:
    store = FlatArenaStore()
    container, model, ref, ref_model = swap_and_reference(
        torch.optim.AdamW, {**KWARGS, "amsgrad": True}, pipeline=pipeline, store=store
    )
    entries = store.entries
    order = [p for g in container.optimizers[0].param_groups for p in g["params"]]
    assert [e.param for e in entries] == order
    assert entries[0].fqn == "embedding.weight" and entries[0].keys == (
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
    )
    assert all(e.shape == e.param.shape and e.dtype == e.param.dtype for e in entries)
    train(model, container, range(10))
    train(ref_model, ref, range(10))
    assert_matches_reference(container, model, ref, ref_model)
    arena = store.arena
    for host in container.param_to_cpu_states_map.values():
        for tensor in host.values():
            assert tensor is None or tensor.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_a_bad_host_cache_from_a_store_names_the_parameter() -> None:
    class Wrong(PinnedHostMemory):
        def allocate(self, entries: Sequence[HostCacheEntry], optimizers: Any) -> dict[torch.Tensor, Any]:
            cache = super().allocate(entries, optimizers)
            cache[entries[-1].param]["exp_avg_sq"] = torch.zeros(1)
            return cache

    with pytest.raises(ValueError, match=r"'1\.bias'\.exp_avg_sq"):
        SwapOptimizersContainer([nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))], torch.optim.AdamW, dict(KWARGS),
                                2, store=Wrong(DeviceBackend("cpu")))


def _config(**overrides: Any) -> OptimizerConfig:
    config = OptimizerConfig(name="AdamW", lr=1e-2, implementation="fused")
    for key, value in overrides.items():
        object.__setattr__(config, key, value)
    return config


def test_wrapper_builds_real_containers() -> None:
    model = nn.Linear(2, 2)
    plain = tt_optimizer.build_optimizers([model], _config(), parallel_dims=None)
    assert type(plain) is tt_optimizer.OptimizersContainer
    swap = tt_optimizer.build_optimizers([model], _config(swap_optimizer=True, swap_optimizer_times=3), None)
    assert type(swap) is SwapOptimizersContainer and swap.swap_optimizer_times == 3
    group = swap.optimizers[0].param_groups[0]
    assert group["lr"] == 1e-2 and group["fused"] is True and group["foreach"] is False


@pytest.mark.parametrize(
    ("overrides", "ft_manager", "match"),
    [
        ({"early_step_in_backward": True}, None, "early_step_in_backward"),
        ({}, types.SimpleNamespace(enabled=True), "TorchFT"),
        ({"name": "Lion"}, None, "Optimizer Lion not added."),
    ],
)
def test_wrapper_rejects_unsupported_setups(overrides: dict[str, Any], ft_manager: Any, match: str) -> None:
    config = _config(swap_optimizer=True, **overrides)
    with pytest.raises(NotImplementedError, match=match):
        tt_optimizer.build_optimizers([nn.Linear(2, 2)], config, None, ft_manager)


def test_wrapper_installation_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    original = swap_optimizer._original_build_optimizers
    assert original.__module__ == "torchtitan.components.optimizer"
    assert not hasattr(original, "__swap_state_original__")
    swap_optimizer.install_build_optimizers_wrapper()
    swap_optimizer.install_build_optimizers_wrapper()
    assert tt_optimizer.build_optimizers is swap_optimizer.build_optimizers
    assert swap_optimizer.build_optimizers.__swap_state_original__ is original  # type: ignore[attr-defined]
    # a module reload computes the original through an installed wrapper, not the wrapper
    assert (
        getattr(tt_optimizer.build_optimizers, "__swap_state_original__", tt_optimizer.build_optimizers)
        is original
    )


def test_parity_with_default_backend_settings() -> None:
    """Without ``pipeline=...`` a CPU process runs in place (no accelerator)."""
    container, model, ref, ref_model = swap_and_reference(torch.optim.Adam, KWARGS, pipeline=None)
    assert not container._steps.enabled()
    train(model, container, range(3))
    train(ref_model, ref, range(3))
    assert_matches_reference(container, model, ref, ref_model)
