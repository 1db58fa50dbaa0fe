"""Whole-state snapshots on a CUDA device, against a real server: the parameter copy of a
snapshot's step runs on a side stream (overlapped with the next forward and backward), the snapshot
holds step N's parameters bit for bit while training goes on, a restore puts them back on the
device, and training continues bitwise equal to torch's fused AdamW on the same device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from snapshot_kit import data_file

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

KWARGS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 64)).cuda()


def _train(model, optimizer, steps):
    for step in steps:
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(step)).cuda()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_cuda_whole_state_snapshot_and_restore_bitwise(start_server):
    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer

    server = start_server(shm_size_bytes=512 << 20)
    model = _model()
    container = RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, dict(KWARGS), 4, server=server.address, job_id="cuda-whole",
        config=RemoteConfig(checkpoint="snapshot"),
    )  # fmt: skip
    _train(model, container, range(1, 4))
    at_3 = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    handle = container.snapshot()
    _train(model, container, range(4, 7))
    stored = load_file(str(data_file(handle.wait_durable(timeout_s=120).path)))
    assert all(torch.equal(stored[k], v) for k, v in at_3.items())
    assert container.restore("latest") == 3
    _train(model, container, range(4, 9))

    reference = _model()
    plain = torch.optim.AdamW(reference.parameters(), **KWARGS)
    _train(reference, plain, range(1, 9))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    container.close()
