"""Checkpoints stay loadable across optimizers, through torchtitan 0.2.2's CheckpointManager and
its strict ``dcp.load`` (CPU, gloo, one rank; the custom config module's hooks installed):

- a plain torch AdamW checkpoint resumes under swap-state (local, remote "full", remote
  "snapshot"), bitwise equal to continuing with plain AdamW;
- a "full" checkpoint resumes under plain AdamW;
- a "snapshot" checkpoint loaded into torch's own AdamW fails naming ``swap-state export``;
- snapshot retention follows ``checkpoint.keep_latest_k``: with 3 (server --keep-latest 2)
  three snapshots stay and ``load(step=<oldest kept>)`` loads.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Checkpoint as CheckpointConfig

import swap_state.client.torchtitan.config  # noqa: F401  (installs the CheckpointManager hooks)
from swap_state.client.optim.checkpoint_template import SnapshotCheckpointError, match_template
from swap_state.client.remote.config import snapshot_retention
from swap_state.client.remote.container import SNAPSHOT_REF_KEY
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from swap_state.client.optim.container import SwapOptimizersContainer

from snapshot_kit import CHUNK, build_wide
from .test_torchtitan_checkpoint import TrainState
from .workload import Workload, build, kwargs, mismatches, remote, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

W = Workload()


def _manager(folder: pathlib.Path, model, optimizers, state, keep_latest_k: int = 0) -> CheckpointManager:
    config = CheckpointConfig(
        enable=True, folder="checkpoint", interval=1, async_mode="disabled", keep_latest_k=keep_latest_k
    )
    return CheckpointManager(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
        states={"train_state": state}, checkpoint_config=config, sd_adapter=None, base_folder=str(folder),
    )  # fmt: skip


def _plain(model) -> OptimizersContainer:
    return OptimizersContainer([model], torch.optim.AdamW, {**kwargs(W), "fused": True})


def _save_plain_at_5(folder: pathlib.Path):
    """Plain fused AdamW (torchtitan's container), 5 steps, checkpoint step-5."""
    model = build(W)
    plain = _plain(model)
    state = TrainState()
    manager = _manager(folder, model, plain, state)
    train(model, plain, W, range(1, 6))
    state.step = 5
    manager.save(curr_step=5)
    manager.close()
    return model, plain


def _reference(steps: int):
    """torch's AdamW continuing past the checkpoint: 5 steps, a load of step-5, more steps."""
    model = build(W)
    plain = _plain(model)
    train(model, plain, W, range(1, steps + 1))
    return model, plain.optimizers[0]


def _optimizer_keys(checkpoint: pathlib.Path) -> set[str]:
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {k for k in metadata if k.startswith("optimizer.")}


@pytest.mark.parametrize("backend", ["local", "full", "snapshot"])
def test_plain_adamw_checkpoint_resumes_under_swap_state_bitwise(start_server, gloo_one_rank, tmp_path, backend):
    _save_plain_at_5(tmp_path)
    keys = _optimizer_keys(tmp_path / "checkpoint" / "step-5")
    assert "optimizer.param_groups.body.weight.step" not in keys  # torch's format has none
    assert "optimizer.state.body.weight.exp_avg" in keys

    fresh_model = build(Workload(seed=7))
    if backend == "local":
        fresh = SwapOptimizersContainer([fresh_model], torch.optim.AdamW, kwargs(W), 2)
    else:
        server = start_server(chunk_bytes=CHUNK)
        fresh = remote(W, fresh_model, server.address, f"plain-{backend}", checkpoint=backend)
    state = TrainState()
    manager = _manager(tmp_path / "resumed", fresh_model, fresh, state)
    manager.folder = str(tmp_path / "checkpoint")  # load the plain run's checkpoints
    calls = _spy(fresh)
    assert manager.load(step=5) is True
    assert state.step == 5
    assert "Restore" not in calls and "Snapshot" not in calls  # the moments came from the checkpoint
    train(fresh_model, fresh, W, range(6, 11))
    ref_model, ref_opt = _reference(10)
    assert mismatches(fresh_model, fresh, ref_model, ref_opt) == []
    group = fresh.optimizers[0].param_groups[0]
    assert float(group["step"]) == 10.0  # derived from the per-parameter steps, then stepped
    if backend == "snapshot":  # the next save refers to a snapshot of the loaded state
        assert fresh.state_dict()[SNAPSHOT_REF_KEY] == "plain-snapshot/step-10"
    manager.close()
    if backend != "local":
        fresh.close()


def test_full_checkpoint_resumes_under_plain_adamw(start_server, gloo_one_rank, tmp_path):
    server = start_server(chunk_bytes=CHUNK)
    model = build(W)
    container = remote(W, model, server.address, "full-to-plain", checkpoint="full")
    state = TrainState()
    manager = _manager(tmp_path, model, container, state)
    train(model, container, W, range(1, 6))
    state.step = 5
    manager.save(curr_step=5)
    manager.close()
    container.close()

    fresh_model = build(Workload(seed=7))
    plain = _plain(fresh_model)
    fresh_state = TrainState()
    fresh_manager = _manager(tmp_path, fresh_model, plain, fresh_state)
    assert fresh_manager.load() is True and fresh_state.step == 5
    train(fresh_model, plain, W, range(6, 11))
    ref_model, ref_opt = _reference(10)
    fresh_opt = plain.optimizers[0]
    for (name, p), q in zip(fresh_model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
        for key, value in ref_opt.state[q].items():
            assert torch.equal(fresh_opt.state[p][key], value), f"{name}.{key}"
    fresh_manager.close()


def test_snapshot_checkpoint_into_plain_adamw_names_swap_state_export(start_server, gloo_one_rank, tmp_path):
    server = start_server(chunk_bytes=CHUNK)
    model = build(W)
    container = remote(W, model, server.address, "snap-to-plain", checkpoint="snapshot")
    state = TrainState()
    manager = _manager(tmp_path, model, container, state)
    train(model, container, W, range(1, 4))
    state.step = 3
    manager.save(curr_step=3)
    manager.close()
    container.close()

    fresh_model = build(W)
    plain = _plain(fresh_model)
    fresh_manager = _manager(tmp_path, fresh_model, plain, TrainState())
    with pytest.raises(SnapshotCheckpointError, match=r"swap-state export") as caught:
        fresh_manager.load()
    message = str(caught.value)
    assert "snap-to-plain/step-3" in message and "Missing key" not in message
    fresh_manager.close()


def test_retention_follows_keep_latest_k(start_server, gloo_one_rank, tmp_path):
    """keep_latest_k=3 with a server keeping 2: the snapshots of every checkpoint torchtitan
    keeps stay (plus one: its last-step save does not purge), the oldest kept loads."""
    server = start_server(chunk_bytes=CHUNK, keep_latest="2")
    model = build(W)
    container = remote(W, model, server.address, "keep3", checkpoint="snapshot")
    state = TrainState()
    manager = _manager(tmp_path, model, container, state, keep_latest_k=3)
    assert container.remote_config.snapshot_keep_latest == 4
    for step in range(1, 6):
        train(model, container, W, range(step, step + 1))
        state.step = step
        manager.save(curr_step=step)
        container.segment.snapshot_handle.wait_durable(timeout_s=60)
    manager.close()  # joins torchtitan's purge thread
    container.close()
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").iterdir())
    assert kept == [3, 4, 5]
    assert _snapshot_steps(server, "keep3") == [2, 3, 4, 5]

    fresh_model = build(Workload(seed=7))
    fresh = remote(W, fresh_model, server.address, "keep3", checkpoint="snapshot")
    fresh_state = TrainState()
    fresh_manager = _manager(tmp_path, fresh_model, fresh, fresh_state, keep_latest_k=3)
    assert fresh_manager.load(step=3) is True and fresh_state.step == 3
    train(fresh_model, fresh, W, range(4, 8))
    ref_model, ref_opt = _reference(7)
    assert mismatches(fresh_model, fresh, ref_model, ref_opt) == []
    fresh_manager.close()
    fresh.close()


def test_keep_latest_k_zero_keeps_every_snapshot(start_server, gloo_one_rank, tmp_path):
    server = start_server(chunk_bytes=CHUNK, keep_latest="2")
    model = build(W)
    container = remote(W, model, server.address, "keep-all", checkpoint="snapshot")
    state = TrainState()
    manager = _manager(tmp_path, model, container, state, keep_latest_k=0)
    assert snapshot_retention(container.remote_config) == {"keep_all": True, "replace_existing": True}
    for step in range(1, 5):
        train(model, container, W, range(step, step + 1))
        state.step = step
        manager.save(curr_step=step)
        container.segment.snapshot_handle.wait_durable(timeout_s=60)
    manager.close()
    container.close()
    assert _snapshot_steps(server, "keep-all") == [1, 2, 3, 4]


def test_template_matching_keeps_every_key_the_checkpoint_holds():
    flat = {
        "state.a.exp_avg": 1, "state.a.exp_avg_sq": 2, "state.a.step": 3,
        "param_groups.a.lr": 4, "param_groups.a.step": 5,
        "state.never.exp_avg": 6, "state.never.exp_avg_sq": 7, "state.never.step": 8,
        "param_groups.never.lr": 9, "param_groups.never.step": 10,
        "state.lost.exp_avg": 11, "state.lost.step": 12, "param_groups.lost.lr": 13,
    }  # fmt: skip
    held = {"state.a.exp_avg", "state.a.exp_avg_sq", "state.a.step", "param_groups.a.lr",
            "param_groups.never.lr", "state.lost.step", "param_groups.lost.lr"}  # fmt: skip
    assert set(match_template(flat, held)) == held | {"state.lost.exp_avg"}  # a real gap stays
    assert match_template(flat, set(flat)) == flat


def _spy(container) -> list[str]:
    calls: list[str] = []
    client = getattr(container, "client", None)
    if client is not None:
        real_call = client.call
        client.call = lambda name, *a, **k: calls.append(name) or real_call(name, *a, **k)
    return calls


def _snapshot_steps(server, job_id: str) -> list[int]:
    client = SwapStateClient(ClientConfig(server.address))
    try:
        return sorted(s.step for s in client.list_snapshots(job_id).snapshots)
    finally:
        client.close()


def test_manager_close_waits_for_the_snapshot_of_the_last_checkpoint(start_server, gloo_one_rank, tmp_path):
    """The last checkpoint refers to a snapshot still persisting when save() returns: the
    trainer's end (CheckpointManager.close) waits until it is durable, so the checkpoint loads
    after the trainer and its embedded server are gone."""
    server = start_server(chunk_bytes=CHUNK, persist_max_bandwidth="512K")
    model = build_wide(W)  # ~0.55 MiB of moments: ~1 s to persist at 512K/s
    container = remote(W, model, server.address, "close-waits", checkpoint="snapshot")
    state = TrainState()
    manager = _manager(tmp_path, model, container, state)
    train(model, container, W, range(1, 4))
    state.step = 3
    manager.save(curr_step=3)
    handle = container._checkpoint_snapshot
    assert handle.snapshot_id == "close-waits/step-3" and handle.status().state == "persisting"
    manager.close()
    assert handle.status().state == "durable"
    container.close()
