"""bfloat16 moments of fp32 parameters (``moment_dtype=torch.bfloat16``; torchtitan 0.3's
``fused_opt_states_bf16``): on CUDA bitwise torch's own fused mixed-precision AdamW; on the CPU,
where torch has no such kernel, bitwise an fp32-compute reference that rounds the moments to
bfloat16 after each step; half the host memory either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from swap_state.client.device import DeviceBackend
from swap_state.client.optim.container import SwapOptimizersContainer

KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "fused": True}


def _models(device: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).to(device)
    second = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).to(device)
    second.load_state_dict(first.state_dict())
    return first, second


def _step(model: nn.Module, optimizer, step: int, device: str) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(device)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _bf16_state_like_torchtitan(optimizer: torch.optim.Optimizer) -> None:
    """torchtitan 0.3's fused_opt_states_bf16 hook: bf16 moments made before torch's own."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param] = {
                "step": torch.zeros((), dtype=torch.float32, device=param.device),
                "exp_avg": torch.zeros_like(param, dtype=torch.bfloat16),
                "exp_avg_sq": torch.zeros_like(param, dtype=torch.bfloat16),
            }


@pytest.mark.parametrize("pipeline", [False, True], ids=["in-place", "pipelined"])
def test_cpu_bf16_moments_match_an_fp32_compute_reference(pipeline: bool) -> None:
    ref_model, swap_model = _models("cpu")
    reference = torch.optim.AdamW(ref_model.parameters(), **KWARGS)
    swap = SwapOptimizersContainer(
        [swap_model], torch.optim.AdamW, dict(KWARGS), 3, moment_dtype=torch.bfloat16, pipeline=pipeline
    )
    for step in range(5):
        _step(ref_model, reference, step, "cpu")
        for state in reference.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16().float())
        _step(swap_model, swap, step, "cpu")
        assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), swap_model.parameters())), step
    saved = swap.state_dict()
    for name, param in ref_model.named_parameters():
        assert saved[f"state.{name}.exp_avg"].dtype == torch.bfloat16
        assert torch.equal(saved[f"state.{name}.exp_avg_sq"], reference.state[param]["exp_avg_sq"].bfloat16())
    moments = [t for cache in swap.param_to_cpu_states_map.values() for k, t in cache.items() if k != "step"]
    assert sum(t.nbytes for t in moments if t is not None) == 2 * 2 * sum(p.numel() for p in swap_model.parameters())


def test_a_bf16_container_loads_an_fp32_checkpoint_rounded_and_refuses_other_dtypes_where_moments_follow_params() -> None:
    _, model = _models("cpu")
    fp32 = SwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2)
    _step(model, fp32, 0, "cpu")
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fp32.state_dict().items()}
    bf16 = SwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2, moment_dtype=torch.bfloat16)
    bf16.load_state_dict(saved)
    assert torch.equal(bf16.state_dict()["state.0.weight.exp_avg"], saved["state.0.weight.exp_avg"].bfloat16())
    halved = {k: v.half() if k.endswith("exp_avg") else v for k, v in saved.items()}
    with pytest.raises(ValueError, match="dtype torch.float16 does not match the parameter's torch.float32"):
        fp32.load_state_dict(halved)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_moments_are_bitwise_torchs_fused_mixed_precision_adamw() -> None:
    ref_model, swap_model = _models("cuda")
    reference = torch.optim.AdamW(ref_model.parameters(), **KWARGS)
    _bf16_state_like_torchtitan(reference)
    swap = SwapOptimizersContainer(
        [swap_model], torch.optim.AdamW, dict(KWARGS), 3, moment_dtype=torch.bfloat16, device_backend=DeviceBackend("cuda")
    )
    for step in range(5):
        _step(ref_model, reference, step, "cuda")
        _step(swap_model, swap, step, "cuda")
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), swap_model.parameters()))
    saved = swap.state_dict()
    for name, param in ref_model.named_parameters():
        assert torch.equal(saved[f"state.{name}.exp_avg"], reference.state[param]["exp_avg"].cpu())
