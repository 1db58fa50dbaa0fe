"""Shared helpers of the swap optimizer tests: models, gradients, bitwise checks, runs."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from swap_state.client.swap_optimizer import STEP_KEY, SwapOptimizersContainer


class ParityModel(nn.Module):
    """Tied embedding/head, two linears, a sometimes-unused and a never-used parameter."""

    SOMETIMES = "sometimes"
    NEVER = "never"

    def __init__(self, mesh: Any = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embedding.weight
        self.sometimes = nn.Parameter(torch.randn(5))
        self.never = nn.Parameter(torch.randn(3, 2))
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            self.sharded = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))


def two_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Linear weights at the default lr, everything else at 5x the lr without decay.

    DTensor parameters get a group of their own with the second group's settings:
    torch's fused kernel cannot mix DTensors and plain tensors in one call.
    """
    named = dict(model.named_parameters())
    first = [
        p for name, p in named.items() if name.endswith("weight") and name.startswith(("proj", "embedding"))
    ]
    rest = [p for p in named.values() if all(p is not q for q in first)]
    groups = [{"params": first}]
    for dtensors in (False, True):
        params = [p for p in rest if isinstance(p, DTensor) == dtensors]
        if params:
            groups.append({"params": params, "lr": 5e-2, "weight_decay": 0.0})
    return groups


def make_grads(model: nn.Module, step: int, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Deterministic gradients by canonical name; ``sometimes`` has none on odd steps."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    grads: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        if name == ParityModel.NEVER or (name == ParityModel.SOMETIMES and step % 2):
            grads[name] = None
            continue
        local = torch.randn(_local(param).shape, generator=generator, dtype=param.dtype)
        if isinstance(param, DTensor):
            local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
        grads[name] = local
    return grads


def apply_grads(model: nn.Module, grads: dict[str, torch.Tensor | None]) -> None:
    for name, param in model.named_parameters():
        grad = grads[name]
        param.grad = None if grad is None else grad.clone()


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def bits(tensor: Any) -> torch.Tensor:
    """The raw bytes of a tensor (DTensor: its local shard), for bitwise comparison."""
    local = _local(tensor).detach().cpu().contiguous()
    return local.reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual: Any, expected: Any, what: str) -> None:
    a, e = _local(actual), _local(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
    )
    assert torch.equal(bits(a), bits(e)), f"{what}: not bitwise equal"


def reference_optimizer(
    model: nn.Module,
    optimizer_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    groups: Callable[..., Any] | None,
) -> torch.optim.Optimizer:
    """torch's own fused optimizer over the same groups."""
    params = groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    return optimizer_cls(params, **{**kwargs, "fused": True, "foreach": False})


def train(model: nn.Module, optimizer: Any, steps: range, seed: int = 0) -> None:
    for step in steps:
        apply_grads(model, make_grads(model, step, seed))
        optimizer.step()


def assert_matches_reference(
    container: SwapOptimizersContainer,
    model: nn.Module,
    ref_optimizer: torch.optim.Optimizer,
    ref_model: nn.Module,
) -> None:
    """Parameters, moments and per-parameter steps bitwise equal to torch's."""
    ref_params = dict(ref_model.named_parameters())
    for name, param in model.named_parameters():
        ref_param = ref_params[name]
        assert_bitwise_equal(param, ref_param, f"param {name}")
        host = container.param_to_cpu_states_map[param]
        ref_state = ref_optimizer.state.get(ref_param, {})
        if not ref_state:  # never stepped: torch has no state, ours must be pristine
            assert float(host[STEP_KEY]) == 0.0, name
            assert all(not host[k].any() for k in ("exp_avg", "exp_avg_sq")), name
            continue
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in ref_state:
                assert_bitwise_equal(host[key], ref_state[key], f"{key} of {name}")
            else:
                assert host.get(key) is None, f"{key} of {name}"
        assert_bitwise_equal(host[STEP_KEY], ref_state["step"], f"step of {name}")


def swap_and_reference(
    optimizer_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    *,
    mesh: Any = None,
    groups: Callable[..., Any] | None = two_groups,
    times: int = 3,
    pipeline: bool | None = False,
    container_cls: type[SwapOptimizersContainer] = SwapOptimizersContainer,
    seed: int = 0,
    **container_kwargs: Any,
) -> tuple[SwapOptimizersContainer, nn.Module, torch.optim.Optimizer, nn.Module]:
    """A container and torch's reference on identical copies of a :class:`ParityModel`."""
    torch.manual_seed(seed)
    model = ParityModel(mesh)
    ref_model = copy.deepcopy(model)
    container = container_cls(
        [model], optimizer_cls, dict(kwargs), times, param_groups=groups, pipeline=pipeline, **container_kwargs
    )
    return container, model, reference_optimizer(ref_model, optimizer_cls, kwargs, groups), ref_model


class Opaque:
    """Holds an object without showing it: printing a zero-storage placeholder segfaults
    torch, and pytest prints the arguments of failing frames."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self.value).__name__} at {id(self.value):#x}>"


def container_snapshot(container: SwapOptimizersContainer) -> dict[str, Any]:
    """Everything ``load_state_dict`` may touch: object identities, values and bytes."""
    snapshot: dict[str, Any] = {"groups": [], "params": []}
    for optim in container.optimizers:
        for group in optim.param_groups:
            snapshot["groups"].append(
                {
                    k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                    for k, v in group.items()
                    if k != "params"
                }
            )
        snapshot["params"].append(dict(optim.param_to_group_map))  # type: ignore[attr-defined]
    snapshot["cpu_map"] = {p: Opaque(v) for p, v in container.param_to_cpu_states_map.items()}
    snapshot["device_map"] = {p: Opaque(v) for p, v in container.param_to_device_states_map.items()}
    snapshot["hosts"] = {
        id(p): {k: (v, None if v is None else bits(v).clone()) for k, v in host.items()}
        for p, host in container.param_to_cpu_states_map.items()
    }
    snapshot["states"] = {
        id(p): {k: Opaque(v) for k, v in state.items()}
        for optim in container.optimizers
        for p, state in optim.state.items()
    }
    return snapshot


def assert_unchanged(container: SwapOptimizersContainer, before: dict[str, Any]) -> None:
    after = container_snapshot(container)
    for old, new in zip(before["groups"], after["groups"], strict=True):
        assert old.keys() == new.keys()
        for key in old:
            if isinstance(old[key], torch.Tensor):
                assert torch.equal(old[key], new[key]), key
            else:
                assert old[key] == new[key], key
    for old, new in zip(before["params"], after["params"], strict=True):
        assert old.keys() == new.keys() and all(old[p] is new[p] for p in old)
    for name in ("cpu_map", "device_map"):
        assert before[name].keys() == after[name].keys()
        assert all(before[name][p].value is after[name][p].value for p in before[name]), name
    assert before["hosts"].keys() == after["hosts"].keys()
    for key, host in before["hosts"].items():
        assert host.keys() == after["hosts"][key].keys()
        for name, (tensor, data) in host.items():
            new_tensor, new_data = after["hosts"][key][name]
            assert new_tensor is tensor, name
            assert data is None or torch.equal(data, new_data), f"host bytes of {name} changed"
    assert before["states"].keys() == after["states"].keys()
    for key, state in before["states"].items():
        new_state = after["states"][key]
        assert state.keys() == new_state.keys() and all(state[k].value is new_state[k].value for k in state)


def named_host(container: SwapOptimizersContainer, model: nn.Module) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, param in model.named_parameters():
        yield name, container.param_to_cpu_states_map[param]
