"""Whole-state snapshots of a model whose checkpoint form a state-dict hook makes (torchtitan
0.3's llama3 splits its fused ``wqkv`` into ``wq``/``wk``/``wv`` on save and merges them on load),
against a real server: the snapshot holds the split form of its step, and a restore puts the
fused parameter back through the module's load hook."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
from snapshot_kit import data_file

pytestmark = pytest.mark.integration


class FusedQKV(nn.Module):
    """One fused weight, checkpointed as three (as torchtitan 0.3's FusedQKVLinear)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wqkv = nn.Parameter(torch.randn(12, 8))
        self.out = nn.Linear(4, 4)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata) -> None:
        fused = state_dict.pop(f"{prefix}wqkv")
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3)):
            state_dict[f"{prefix}{name}"] = part.contiguous()  # fresh tensors, not views

    @staticmethod
    def _merge(module, state_dict, prefix, *args) -> None:
        names = [f"{prefix}{name}" for name in ("wq", "wk", "wv")]
        if all(name in state_dict for name in names):
            state_dict[f"{prefix}wqkv"] = torch.cat([state_dict.pop(name) for name in names])

    def forward(self, x):
        q, k, v = (x @ self.wqkv.T).chunk(3, dim=-1)
        return self.out(torch.tanh(q * k + v))


def _train(model, optimizer, steps) -> None:
    for step in steps:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_hook_split_parameter_is_snapshotted_split_and_restored_fused(start_server):
    server = start_server()
    model = FusedQKV()
    config = RemoteConfig(checkpoint="snapshot", model_state_dict=nn.Module.state_dict)
    container = RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-2}, 2, server=server.address, job_id="derived", config=config
    )
    _train(model, container, range(1, 4))
    at_3 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    status = container.snapshot().wait_durable(timeout_s=60)
    stored = load_file(str(data_file(status.path)))
    assert sorted(k for k in stored if k.startswith("model.")) == [
        "model.out.bias", "model.out.weight", "model.wk", "model.wq", "model.wv"
    ]  # fmt: skip
    for name in ("wq", "wk", "wv"):
        assert torch.equal(stored[f"model.{name}"], at_3[name]), name
    _train(model, container, range(4, 6))  # steps the restore takes back
    assert not torch.equal(model.wqkv.detach(), torch.cat([at_3["wq"], at_3["wk"], at_3["wv"]]))
    assert container.restore("latest") == 3
    assert torch.equal(model.wqkv.detach(), torch.cat([at_3["wq"], at_3["wk"], at_3["wv"]]))
    assert torch.equal(model.out.weight.detach(), at_3["out.weight"])
    container.close()
