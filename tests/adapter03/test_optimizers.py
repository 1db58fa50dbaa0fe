"""SwapStateOptimizersContainer under torchtitan 0.3, against torchtitan's own
OptimizersContainer built from the same Config: param groups with their own hyperparameters,
both backends (the remote one on a real server), checkpoints in both directions, other
optimizers' groups, and bfloat16 moments (fused_opt_states_bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from swap_state.client.optim.container import SwapOptimizersContainer
from swap_state.client.torchtitan.optimizers_v03 import SwapStateOptimizersContainer

GROUPS = [
    ParamGroupConfig(pattern=r"\.bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2, "betas": (0.8, 0.9)}),
    ParamGroupConfig(pattern=r"^2\.", optimizer_name="AdamW", optimizer_kwargs={"lr": 5e-3, "weight_decay": 0.3}),
    ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3, "eps": 1e-6}),
]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def _train(model: nn.Module, optimizers, steps: range) -> None:
    for step in steps:
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(step))
        optimizers.zero_grad()
        model(x).square().sum().backward()
        optimizers.step()


def _cloned(state_dict: dict) -> dict:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state_dict.items()}


def _swap_config(server=None, **settings) -> SwapStateOptimizersContainer.Config:
    backend = {"swap_optimizer_backend": "remote", "swap_state_server": server.address} if server else {"swap_optimizer_backend": "local"}
    settings = {"param_groups": GROUPS, **backend, **settings}
    return SwapStateOptimizersContainer.Config(swap_optimizer_times=2, **settings)


@pytest.fixture(params=["local", "remote"])
def build_swap(request, start_server):
    """``build_swap(model, **settings)`` -> the container SwapStateOptimizersContainer.Config
    builds for ``model`` with the param's backend (remote: a real server); closed after the test."""
    server = start_server() if request.param == "remote" else None
    built = []

    def build(model: nn.Module, **settings):
        config = _swap_config(server, swap_state_job_id=f"job-{len(built)}", **settings)
        built.append(config.build(model_parts=[model]))
        return built[-1]

    yield build
    for container in built:
        getattr(container, "close", lambda: None)()


def test_param_groups_train_bitwise_as_torchtitans_own(build_swap):
    plain_model, swap_model = _model(), _model()
    plain = OptimizersContainer.Config(param_groups=GROUPS).build(model_parts=[plain_model])
    swap = build_swap(swap_model)
    # torchtitan's trainer uses it through torchtitan's container calls; it is not torchtitan's class
    # (a plain PyTorch loop uses the same container without torchtitan).
    assert not isinstance(swap, OptimizersContainer) and len(list(swap)) == len(swap)
    _train(plain_model, plain, range(4))
    _train(swap_model, swap, range(4))
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), swap_model.parameters()))
    hyper = {(g["lr"], g["weight_decay"], g["decoupled_weight_decay"]) for g in swap.optimizers[0].param_groups}
    assert hyper == {(1e-2, 0.0, False), (5e-3, 0.3, True), (1e-3, 0.01, True)}
    plain_sd, swap_sd = plain.state_dict(), swap.state_dict()
    assert set(swap_sd) - set(plain_sd) == {k for k in swap_sd if k.startswith("param_groups.") and k.endswith(".step")}
    for key, value in plain_sd.items():
        assert torch.equal(value, swap_sd[key]) if isinstance(value, torch.Tensor) else value == swap_sd[key], key


def test_checkpoints_load_across_plain_and_swap_both_ways(build_swap):
    plain_model, swap_model = _model(), _model()
    plain = OptimizersContainer.Config(param_groups=GROUPS).build(model_parts=[plain_model])
    _train(plain_model, plain, range(3))
    swap_model.load_state_dict(plain_model.state_dict())
    swap = build_swap(swap_model)
    swap.load_state_dict(plain.state_dict())  # plain -> swap
    _train(plain_model, plain, range(3, 6))
    _train(swap_model, swap, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), swap_model.parameters()))
    back_model = _model()
    back_model.load_state_dict(swap_model.state_dict())
    back = OptimizersContainer.Config(param_groups=GROUPS).build(model_parts=[back_model])
    # Cloned: torch's load keeps tensors of the right dtype and device as they are, and these
    # are views of swap's host cache (DCP loads into the template's own tensors).
    back.load_state_dict(_cloned(swap.state_dict()))  # swap -> plain
    _train(back_model, back, range(6, 8))
    _train(swap_model, swap, range(6, 8))
    assert all(torch.equal(a, b) for a, b in zip(back_model.parameters(), swap_model.parameters()))


@pytest.fixture
def sgd_is_torchtitans(monkeypatch):
    """torchtitan 0.3 builds Adam, AdamW and DistMuon (which needs a FlexShard mesh); a test's
    stand-in for an optimizer swap-state leaves to torchtitan: SGD with momentum."""
    original = OptimizersContainer._resolve_optimizer_factory

    def resolve(name):
        return torch.optim.SGD if name == "SGD" else original(name)

    monkeypatch.setattr(OptimizersContainer, "_resolve_optimizer_factory", staticmethod(resolve))


OTHER = [ParamGroupConfig(pattern=r"\.bias$", optimizer_name="SGD", optimizer_kwargs={"lr": 0.05, "momentum": 0.9}), *GROUPS[1:]]


@pytest.mark.usefixtures("sgd_is_torchtitans")
def test_groups_of_other_optimizers_are_left_to_torchtitan_and_checkpointed_beside(build_swap, caplog):
    plain_model, swap_model = _model(), _model()
    plain = OptimizersContainer.Config(param_groups=OTHER).build(model_parts=[plain_model])
    with caplog.at_level("INFO", logger="swap_state.client"):
        swap = build_swap(swap_model, param_groups=OTHER)
    assert "leaves param groups SGD [\\.bias$]" in caplog.text
    assert [type(o).__name__ for o in swap] == ["AdamW", "SGD"]  # what LR schedulers iterate
    _train(plain_model, plain, range(3))
    _train(swap_model, swap, range(3))
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), swap_model.parameters()))
    plain_sd, swap_sd = plain.state_dict(), swap.state_dict()
    assert "state.0.bias.momentum_buffer" in swap_sd
    for key, value in plain_sd.items():
        assert torch.equal(value, swap_sd[key]) if isinstance(value, torch.Tensor) else value == swap_sd[key], key
    other_model = _model()
    other_model.load_state_dict(swap_model.state_dict())
    resumed = build_swap(other_model, param_groups=OTHER)
    resumed.load_state_dict(_cloned(swap_sd))
    _train(swap_model, swap, range(3, 5))
    _train(other_model, resumed, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(other_model.parameters(), swap_model.parameters()))


@pytest.mark.usefixtures("sgd_is_torchtitans")
def test_snapshot_checkpoints_refuse_groups_they_cannot_hold(start_server):
    config = SwapStateOptimizersContainer.Config(
        param_groups=OTHER, swap_state_checkpoint="snapshot", swap_state_server=start_server().address
    )
    with pytest.raises(NotImplementedError, match=r"param groups SGD \[\\\.bias\$\] are not Adam or AdamW.*'full'"):
        config.build(model_parts=[_model()])


def test_bf16_moments_match_an_fp32_compute_reference_and_stay_bf16(build_swap):
    """torch's fused AdamW on the CPU refuses bfloat16 state: the reference is torch's fp32
    fused AdamW whose moments are rounded to bfloat16 after each step (what the CUDA
    mixed-precision kernel stores)."""
    ref_model, swap_model = _model(), _model()
    ref = OptimizersContainer.Config(param_groups=GROUPS).build(model_parts=[ref_model])
    swap = build_swap(swap_model, implementation="fused_opt_states_bf16")
    for step in range(4):
        _train(ref_model, ref, range(step, step + 1))
        for state in (state for optimizer in ref.optimizers for state in optimizer.state.values()):
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16().float())
        _train(swap_model, swap, range(step, step + 1))
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), swap_model.parameters()))
    swap_sd, ref_sd = swap.state_dict(), ref.state_dict()
    moments = [key for key in swap_sd if key.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and all(swap_sd[key].dtype == torch.bfloat16 for key in moments)
    assert all(torch.equal(swap_sd[key], ref_sd[key].bfloat16()) for key in moments)
    host_bytes = sum(t.nbytes for cache in swap.param_to_cpu_states_map.values() for k, t in cache.items() if k != "step" and t is not None)
    assert host_bytes == sum(2 * 2 * p.numel() for p in swap_model.parameters())  # two bf16 moments


def test_bf16_moments_stay_bf16_in_a_snapshot_and_its_export(start_server, tmp_path):
    from swap_state.client.export.snapshot import locate, read_snapshot_state

    server = start_server(snapshot_dir=tmp_path)
    model = _model()
    config = _swap_config(server, swap_state_job_id="bf16snap", swap_state_checkpoint="snapshot",
                          implementation="fused_opt_states_bf16")  # fmt: skip
    swap = config.build(model_parts=[model])
    try:
        _train(model, swap, range(2))
        full = SwapOptimizersContainer.state_dict(swap)  # the seed's dict, whatever the mode
        live = {key: value.clone() for key, value in full.items() if key.endswith("exp_avg")}
        status = swap.snapshot().wait_durable(timeout_s=60)
        exported = read_snapshot_state(locate(status.path)).flat
    finally:
        swap.close()
    moments = {key: value for key, value in exported.items() if key.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and {value.dtype for value in moments.values()} == {torch.bfloat16}
    assert live and all(torch.equal(exported[key], value) for key, value in live.items())
