"""Whole-state snapshots against a real server process: the snapshot of step N holds the model's
parameters (and persistent buffers) of step N beside the moments, while the trainer steps on;
a restore puts them back into the model; the manifest describes them.

The snapshot files are read with the ``safetensors`` library only; "bitwise" compares bytes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from swap_state.client.errors import SnapshotFailedError, SwapStateError
from swap_state.client.optim.checkpoint_template import SNAPSHOT_REF_KEY
from swap_state.client.remote.container import PARAM_STEPS, RemoteConfig, RemoteSwapOptimizersContainer
from swap_state.common.segment import Word

from snapshot_kit import CHUNK, bitwise_diff, build_wide, data_file, params_copy, rank_manifest, record_state, reference
from .workload import Workload, mismatches, remote, train

pytestmark = pytest.mark.integration

W = Workload()
SLOW = "512K"  # a writer cap that makes persisting a WideNet's state take about a second


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}


class TiedNet(nn.Module):
    """Tied embedding and head, plus a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.embed(x)) * self.scale))


def _train_tied(model, optimizer, steps):
    for step in steps:
        x = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_snapshot_holds_the_parameters_of_its_step_while_training_goes_on(start_server):
    server = start_server(chunk_bytes=CHUNK, persist_max_bandwidth=SLOW, cow_budget="128K")
    model = build_wide(W)
    container = remote(W, model, server.address, "whole", checkpoint="snapshot")
    train(model, container, W, range(1, 4))
    at_n = {**record_state(model, container), **_model_state(model)}
    handle = container.snapshot()
    train(model, container, W, range(4, 7))  # overwrites parameters while the writer is slow
    assert not torch.equal(model.body.weight, at_n["model.body.weight"])
    status = handle.wait_durable(timeout_s=120)
    stored = load_file(str(data_file(status.path)))
    assert bitwise_diff(at_n, stored) == []
    manifest = rank_manifest(status.path)
    entries = {t["name"]: t for t in manifest["tensors"]}
    assert entries["model.body.weight"]["fqn"] == "body.weight"
    assert entries["model.body.weight"]["key"] == "param"
    assert set(entries) >= set(at_n)
    container.close()


def test_restore_puts_the_parameters_back_and_training_continues_bitwise(start_server):
    server = start_server()
    model = build_wide(W)
    container = remote(W, model, server.address, "restore-whole", checkpoint="snapshot")
    train(model, container, W, range(1, 6))
    container.snapshot().wait_durable(timeout_s=60)
    train(model, container, W, range(6, 9))  # steps that the restore takes back
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # and a model that is not step 5's at all
    assert container.restore("latest") == 5
    train(model, container, W, range(6, W.steps + 1))
    assert mismatches(model, container, *reference(W, build_wide, W.steps)) == []
    container.close()


def test_tied_weights_are_stored_once_and_persistent_buffers_with_them(start_server):
    server = start_server()
    model = TiedNet()
    container = remote(W, model, server.address, "tied", checkpoint="snapshot")
    _train_tied(model, container, range(1, 3))
    status = container.snapshot().wait_durable(timeout_s=60)
    stored = load_file(str(data_file(status.path)))
    model_keys = sorted(k for k in stored if k.startswith("model."))
    assert model_keys == ["model.body.bias", "model.body.weight", "model.embed.weight", "model.scale"]
    assert torch.equal(stored["model.embed.weight"], model.head.weight.detach())
    entries = {t["name"]: t for t in rank_manifest(status.path)["tensors"]}
    assert entries["model.scale"]["key"] == "buffer"
    assert rank_manifest(status.path)["metadata_extra"] == {"model_aliases": {"head.weight": "embed.weight"}}
    container.close()


def test_full_mode_keeps_the_moments_only(start_server):
    server = start_server()
    model = build_wide(W)
    container = remote(W, model, server.address, "full-only")
    train(model, container, W, range(1, 3))
    stored = load_file(str(data_file(container.snapshot().wait_durable(timeout_s=60).path)))
    assert not [k for k in stored if k.startswith("model.")]
    container.close()


def _snapshot_without_the_models_copy(start_server, job_id: str):
    """(container, handle): the snapshot of step 2 asked for as a trainer that died between
    its commit and the end of its copy of the model would leave it (the server waits 1 s)."""
    server = start_server(model_copy_timeout="1")
    model = build_wide(W)
    container = remote(W, model, server.address, job_id, checkpoint="snapshot")
    train(model, container, W, range(1, 3))
    container.segment.mapping.header[Word.MODEL_STEP] = 0
    ident, base, delta = container.store.metadata.parts(container.segment.views[PARAM_STEPS])
    return container, container.session.snapshot(2, metadata_base_id=ident, metadata_base_json=base,
                                                 metadata_delta_json=delta)


def test_a_trainer_that_never_copies_the_model_fails_the_snapshot_not_silently(start_server):
    container, handle = _snapshot_without_the_models_copy(start_server, "no-copy")
    with pytest.raises(SwapStateError, match="did not copy the model's parameters of step 2"):
        container.segment.handle_for(handle.snapshot_id).wait_durable(timeout_s=30)
    container.close()


def test_quiet_steps_copy_no_parameters_only_a_snapshot_step_does(start_server):
    server = start_server()
    model = build_wide(W)
    container = remote(W, model, server.address, "quiet", checkpoint="snapshot")
    train(model, container, W, range(1, 4))
    assert container.segment.mapping.header[Word.MODEL_STEP] == 0  # three steps, no copy of the model
    at_3 = params_copy(model)
    handle = container.snapshot()  # starts the copy of step 3's parameters, returns at once
    train(model, container, W, range(4, 6))  # the update of step 4 waits for that copy only
    stored = load_file(str(data_file(handle.wait_durable(timeout_s=60).path)))
    assert bitwise_diff({f"model.{k}": v for k, v in at_3.items()}, {k: v for k, v in stored.items() if k.startswith("model.")}) == []
    assert container.segment.mapping.header[Word.MODEL_STEP] == 4  # still step 3's: steps 4 and 5 copied nothing
    container.close()


KILLED_AFTER_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch, torch.nn as nn
    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
    torch.manual_seed(0)
    # One weight above 2**24 elements (a real LLM's embedding is larger): its copy into the
    # segment takes long enough for a kill right after the save to land before it ends.
    model = nn.Sequential(nn.Linear(12, 4096), nn.Tanh(), nn.Linear(4096, 4100))
    container = RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, dict(lr=1e-2), 2, server={address!r}, job_id="killed-after-save",
        config=RemoteConfig(checkpoint="snapshot"))
    for step in (1, 2):
        model(torch.randn(4, 12, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        container.step()
        container.zero_grad()
    torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, {expected!r})
    torch.save(container.state_dict(), {checkpoint!r})  # what a checkpoint's save writes
    os.kill(os.getpid(), signal.SIGKILL)  # a crash right after the save returned
    """
)


def test_a_trainer_killed_right_after_a_checkpoint_save_leaves_a_snapshot_that_restores(start_server, tmp_path):
    """The save of a snapshot-mode checkpoint returns once the trainer's part of the snapshot
    (the model's copy into the segment) is there: the server completes it without the trainer,
    and the rerun restores the parameters of the saved step."""
    server = start_server(shm_size_bytes=1 << 30, model_copy_timeout="5")
    expected, checkpoint = tmp_path / "expected.pt", tmp_path / "checkpoint.pt"
    code = KILLED_AFTER_SAVE.format(address=server.address, expected=str(expected), checkpoint=str(checkpoint))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    torch.manual_seed(1)  # another init: the restore must bring the saved parameters
    model = nn.Sequential(nn.Linear(12, 4096), nn.Tanh(), nn.Linear(4096, 4100))
    container = RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, dict(lr=1e-2), 2, server=server.address, job_id="killed-after-save",
        config=RemoteConfig(checkpoint="snapshot"))
    container.load_state_dict(torch.load(checkpoint))
    assert bitwise_diff(torch.load(expected), params_copy(model)) == []
    container.close()


def test_a_checkpoint_whose_snapshot_failed_says_to_load_an_earlier_one(start_server):
    container, handle = _snapshot_without_the_models_copy(start_server, "failed-ref")
    with pytest.raises(SnapshotFailedError, match=r"load an earlier checkpoint \(torchtitan: --checkpoint.load_step"):
        container.load_state_dict({SNAPSHOT_REF_KEY: handle.snapshot_id})
    container.close()
