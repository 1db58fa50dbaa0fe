"""Real LLM tensor shapes through every path, bitwise equal to torch's fused AdamW.

The toy models of the other tests stay below 2^24 elements per tensor, where float32 index
arithmetic is still exact; real models do not. Here:

- Llama-3-8B's MLP projection, a 14336x4096 fp32 weight (58.7M elements), through the remote
  container in whole-state mode: attach, steps, commit, the reattach check (kept and dropped),
  a snapshot taken while training goes on, restore, export; the in-process container and the
  torchtitan glue (both backends) at the same shape;
- Qwen2.5-7B's embedding, 152064x3584 fp32 (545M elements), whose moments are over 2^31 bytes
  each and whose segment (moments, then the model tensor) ends past 2^32 bytes: steps,
  snapshot, restore. It needs about 14 GiB of memory; where the machine has less it skips,
  saying how much it needs and has. To hold one copy of the state, not two, its comparison
  with the reference is by CRC-32 of every tensor's bytes.

These tests cost memory, not much time: the models are one big tensor between small layers.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.nn as nn
import torchtitan.components.optimizer as tt_optimizer
from safetensors import safe_open
from safetensors.torch import load_file

from swap_state.client.export.snapshot import export_snapshot
from swap_state.client.remote.container import RemoteSwapOptimizersContainer
from swap_state.client.swap_optimizer import SwapOptimizersContainer
from swap_state.common.checksum import crc32
from swap_state.common.segment import Word

from snapshot_kit import bitwise_diff, data_file, params_copy, record_state
from .workload import Workload, kwargs, mismatches, parse_titan_toml, remote, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

W = Workload()
LLAMA3_8B_MLP = (14336, 4096)
QWEN25_7B_EMBEDDING = (152064, 3584)
REMOTE_LOGGER = "swap_state.client"


class MlpNet(nn.Module):
    """A real 14336x4096 weight between two small layers; takes the workload's 16x12 input."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, LLAMA3_8B_MLP[1])
        self.w1 = nn.Linear(LLAMA3_8B_MLP[1], LLAMA3_8B_MLP[0], bias=False)
        self.head = nn.Linear(LLAMA3_8B_MLP[0], 6)

    def forward(self, x):
        return self.head(torch.tanh(self.w1(torch.tanh(self.body(x)))))


class EmbeddingNet(nn.Module):
    """A real 152064x3584 embedding (545M elements, 2.18 GB; each moment over 2^31 bytes)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(*QWEN25_7B_EMBEDDING)
        self.head = nn.Linear(QWEN25_7B_EMBEDDING[1], 6)

    def forward(self, x):
        # Token ids spread over the whole table, first and last rows included.
        ids = (x.abs() * 1e6).long() % QWEN25_7B_EMBEDDING[0]
        ids[0, 0], ids[-1, -1] = 0, QWEN25_7B_EMBEDDING[0] - 1
        return self.head(self.embed(ids).mean(dim=1))


def build_mlp(w: Workload = W) -> MlpNet:
    torch.manual_seed(w.seed)
    return MlpNet()


def fused_adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), fused=True, **kwargs(W))


def whole_state(model: nn.Module, container) -> dict[str, torch.Tensor]:
    """Copies of what a whole-state snapshot holds: moments, step counts and parameters."""
    return {**record_state(model, container), **{f"model.{k}": v for k, v in params_copy(model).items()}}


def test_a_llama3_8b_mlp_weight_through_the_remote_container_bitwise(start_server, tmp_path, caplog):
    server = start_server(shm_size_bytes=2 << 30)
    ref_model = build_mlp()
    ref = fused_adamw(ref_model)
    model = build_mlp()
    assert model.w1.weight.numel() > 2**24
    first = remote(W, model, server.address, "llama3-mlp", checkpoint="snapshot")
    train(model, first, W, range(1, 3))
    train(ref_model, ref, W, range(1, 3))
    assert mismatches(model, first, ref_model, ref) == []

    # Reattach: the fingerprint of a 58.7M-element weight is checked, and it matches.
    kept = params_copy(model)
    first.close(keep=True)
    model = build_mlp()
    model.load_state_dict(kept)
    second = remote(W, model, server.address, "llama3-mlp", checkpoint="snapshot")
    assert second.resumed_step == 2
    with caplog.at_level(logging.WARNING, logger=REMOTE_LOGGER):
        train(model, second, W, range(3, 4))
    assert "dropping" not in caplog.text
    train(ref_model, ref, W, range(3, 4))
    assert mismatches(model, second, ref_model, ref) == []

    # A snapshot of step 3 while steps 4 and 5 overwrite the state it holds.
    at_3 = whole_state(model, second)
    handle = second.snapshot()
    train(model, second, W, range(4, 6))
    train(ref_model, ref, W, range(4, 6))
    status = handle.wait_durable(timeout_s=240)
    assert bitwise_diff(at_3, load_file(str(data_file(status.path)))) == []

    # Restore takes the model and the moments back to step 3; training continues bitwise.
    assert second.restore("latest") == 3
    assert bitwise_diff(at_3, whole_state(model, second)) == []
    train(model, second, W, range(4, 6))
    assert mismatches(model, second, ref_model, ref) == []

    # Export: the seed's flat state dict, read with plain torch.load.
    exported = tmp_path / "step-3.pt"
    export_snapshot(status.path, exported, "torch")
    flat = torch.load(exported, weights_only=True)
    moments = {k: v for k, v in at_3.items() if k.startswith("state.") and not k.endswith(".step")}
    assert bitwise_diff(moments, flat) == []

    # A rerun from fresh weights with the same job id: the kept state is dropped, not used.
    second.close(keep=True)
    fresh = build_mlp()
    third = remote(W, fresh, server.address, "llama3-mlp", checkpoint="snapshot")
    assert third.resumed_step == 5
    with caplog.at_level(logging.WARNING, logger=REMOTE_LOGGER):
        train(fresh, third, W, range(1, 2))
    assert "dropping the swap-state optimizer state kept for job llama3-mlp rank 0 at step 5" in caplog.text
    assert third.segment.mapping.header[Word.STATE_DROPS] == 1
    third.close()


@pytest.mark.parametrize("backend", ["local", "remote"])
def test_the_torchtitan_glue_at_the_llama3_mlp_shape_is_bitwise(start_server, tmp_path, backend):
    """torchtitan 0.2's build_optimizers with the swap switch on: the in-process container
    (``local``) and the remote one, each bitwise, and the seed's flat state dict."""
    server = start_server(shm_size_bytes=1 << 30)
    config = parse_titan_toml(
        tmp_path,
        'name = "AdamW"\nlr = 0.01\nbeta1 = 0.9\nbeta2 = 0.95\nweight_decay = 0.1\n'
        f'swap_optimizer = true\nswap_optimizer_times = 4\nswap_optimizer_backend = "{backend}"\n'
        f'swap_state_server = "{server.address}"\nswap_state_job_id = "tt-{backend}"\n',
    )
    model, ref_model = build_mlp(), build_mlp()
    container = tt_optimizer.build_optimizers([model], config.optimizer, None, None)
    expected = RemoteSwapOptimizersContainer if backend == "remote" else SwapOptimizersContainer
    assert type(container) is expected
    ref = fused_adamw(ref_model)
    train(model, container, W, range(1, 4))
    train(ref_model, ref, W, range(1, 4))
    assert mismatches(model, container, ref_model, ref) == []
    state = container.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[f"state.w1.weight.{key}"], ref.state[ref_model.w1.weight][key])
    if backend == "remote":
        container.close()


# ---------------------------------------------------------------- over 2^31 bytes per moment

BIG_PARAM_BYTES = QWEN25_7B_EMBEDDING[0] * QWEN25_7B_EMBEDDING[1] * 4
BIG_SEGMENT_BYTES = 3 * BIG_PARAM_BYTES + (64 << 20)  # moments, model tensor, the small rest
BIG_MEMORY_NEEDED = BIG_SEGMENT_BYTES + 2 * BIG_PARAM_BYTES + (2 << 30)  # + param, grad, slack


def _available_bytes(path: str = "/proc/meminfo") -> int:
    with open(path) as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _skip_without_memory_for_the_big_embedding(shm_dir: str) -> None:
    gib = 1 << 30
    have, shm_free = _available_bytes(), shutil.disk_usage(shm_dir).free
    if have < BIG_MEMORY_NEEDED or shm_free < BIG_SEGMENT_BYTES + gib:
        pytest.skip(
            f"needs {BIG_MEMORY_NEEDED / gib:.1f} GiB of available memory and "
            f"{(BIG_SEGMENT_BYTES + gib) / gib:.1f} GiB free in {shm_dir} for a 152064x3584 "
            f"embedding's state; this machine has {have / gib:.1f} GiB and {shm_free / gib:.1f} GiB"
        )


def _digests(model: nn.Module, moments_of) -> dict[str, int]:
    """CRC-32 of the bytes of every parameter and of its exp_avg, exp_avg_sq and step."""
    out: dict[str, int] = {}
    for name, param in model.named_parameters():
        state = moments_of(param)
        tensors = {"param": param.detach(), **{k: state[k] for k in ("exp_avg", "exp_avg_sq", "step")}}
        for key, tensor in tensors.items():
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[f"{name}.{key}"] = crc32(memoryview(raw))
    return out


def _reference_digests(steps: tuple[int, ...]) -> dict[int, dict[str, int]]:
    """Digests of a fused AdamW run at each of ``steps``; its memory is gone on return."""
    torch.manual_seed(W.seed)
    model = EmbeddingNet()
    optimizer = fused_adamw(model)
    out, done = {}, 0
    for step in steps:
        train(model, optimizer, W, range(done + 1, step + 1))
        out[step], done = _digests(model, lambda p: optimizer.state[p]), step
    return out


def _first_and_last_rows_match(path: str, container, model: EmbeddingNet) -> None:
    """The file's big tensors, read through the safetensors library at their offsets past
    2^31 and 2^32 bytes, hold the host cache's and the model's first and last rows."""
    host = container.param_to_cpu_states_map[model.embed.weight]
    expected = {
        "state.embed.weight.exp_avg": host["exp_avg"],
        "state.embed.weight.exp_avg_sq": host["exp_avg_sq"],
        "model.embed.weight": model.embed.weight.detach(),
    }
    with safe_open(str(data_file(path)), "pt") as f:
        for name, tensor in expected.items():
            rows = f.get_slice(name)
            assert torch.equal(rows[0:1], tensor[0:1]), name
            assert torch.equal(rows[-1:], tensor[-1:]), name


def test_moments_over_2_31_bytes_in_a_segment_past_2_32_bytes_bitwise(start_server, private_shm_dir, tmp_path):
    _skip_without_memory_for_the_big_embedding(private_shm_dir)
    reference = _reference_digests((2, 3))
    server = start_server(shm_size_bytes=BIG_SEGMENT_BYTES + (512 << 20), snapshot_dir=tmp_path / "snapshots",
                          cow_budget="256M")
    torch.manual_seed(W.seed)
    model = EmbeddingNet()
    container = remote(W, model, server.address, "qwen-embedding", checkpoint="snapshot", rpc_timeout_s=120.0)
    moments = container.param_to_cpu_states_map.__getitem__
    try:
        layout = {t.name: t for t in container.segment.mapping.tensors}
        assert layout["state.embed.weight.exp_avg_sq"].nbytes > 2**31
        assert layout["model.embed.weight"].offset + layout["model.embed.weight"].nbytes > 2**32
        train(model, container, W, range(1, 3))
        assert _digests(model, moments) == reference[2]

        status = container.snapshot().wait_durable(timeout_s=300)
        assert os.path.getsize(data_file(status.path)) > 2**32
        _first_and_last_rows_match(status.path, container, model)
        train(model, container, W, range(3, 4))
        assert _digests(model, moments) == reference[3]

        assert container.restore("latest") == 2
        assert _digests(model, moments) == reference[2]
        train(model, container, W, range(3, 4))
        assert _digests(model, moments) == reference[3]
    finally:
        container.close()
        shutil.rmtree(tmp_path / "snapshots", ignore_errors=True)
