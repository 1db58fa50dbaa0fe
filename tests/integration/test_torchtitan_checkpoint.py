"""torchtitan 0.2.2's CheckpointManager (CPU, gloo, one rank) saving and loading the remote
container, in ``checkpoint="snapshot"`` mode (the optimizer's entry is a reference to a
server-side snapshot) and in ``"full"`` mode (the seed's full-tensor state dict)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.config import Checkpoint as CheckpointConfig

from swap_state.client.remote.container import SNAPSHOT_JOB_KEY, SNAPSHOT_REF_KEY, SnapshotHandle
from swap_state.common.segment import Word

from snapshot_kit import (
    CHUNK,
    bitwise_diff,
    build_wide,
    data_file,
    moment_bytes,
    params_copy,
    record_state,
    reference,
)
from .workload import Workload, mismatches, remote, train

pytestmark = pytest.mark.integration

W = Workload()
#: Writer cap that makes persisting a WideNet (~0.55 MiB of moments) take ~1 s.
SLOW = "512K"


class TrainState(Stateful):
    """torchtitan's train_state, reduced to the step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict) -> None:
        self.step = int(state_dict["step"])


def _manager(folder: pathlib.Path, model, container, train_state) -> CheckpointManager:
    config = CheckpointConfig(
        enable=True, folder="checkpoint", interval=5, async_mode="disabled", keep_latest_k=0
    )
    return CheckpointManager(
        dataloader=None,
        model_parts=[model],
        optimizers=container,
        lr_schedulers=None,
        states={"train_state": train_state},
        checkpoint_config=config,
        sd_adapter=None,
        base_folder=str(folder),
    )


def _spy_rpcs(container) -> list[str]:
    calls: list[str] = []
    real_call = container.client.call
    container.client.call = lambda name, *a, **k: calls.append(name) or real_call(name, *a, **k)
    return calls


def _optimizer_tensor_bytes(checkpoint: pathlib.Path) -> tuple[int, list[str]]:
    """Tensor bytes under ``optimizer.`` in a DCP checkpoint, and the optimizer keys."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    keys = sorted(k for k in metadata if k.startswith("optimizer."))
    total = 0
    for key in keys:
        item = metadata[key]
        if isinstance(item, TensorStorageMetadata):
            total += item.size.numel() * item.properties.dtype.itemsize
    return total, keys


@pytest.mark.parametrize("mode", ["snapshot", "full"])
def test_checkpoint_manager_save_then_load_in_fresh_container_is_bitwise(
    start_server, gloo_one_rank, tmp_path, mode
):
    server = start_server(chunk_bytes=CHUNK)
    job = f"tt-{mode}"
    model = build_wide(W)
    container = remote(W, model, server.address, job, checkpoint=mode)
    state = TrainState()
    manager = _manager(tmp_path, model, container, state)
    train(model, container, W, range(1, 6))
    state.step = 5
    calls = _spy_rpcs(container)
    manager.save(curr_step=5)
    moments = moment_bytes(model)
    saved_bytes, keys = _optimizer_tensor_bytes(tmp_path / "checkpoint" / "step-5")
    if mode == "snapshot":
        assert calls == ["Snapshot"]  # the trainer's whole cost: one RPC, no moment bytes
        assert f"optimizer.{SNAPSHOT_REF_KEY}" in keys
        assert not any(k.endswith((".exp_avg", ".exp_avg_sq")) for k in keys)
        assert saved_bytes < moments / 100
    else:
        assert calls == []
        assert "optimizer.state.mid.weight.exp_avg" in keys and saved_bytes >= moments
    train(model, container, W, range(6, 8))  # the live state moves on past the checkpoint
    manager.close()
    container.close()

    fresh_model = build_wide(Workload(seed=7))
    fresh = remote(W, fresh_model, server.address, job, checkpoint=mode)
    fresh_state = TrainState()
    fresh_manager = _manager(tmp_path, fresh_model, fresh, fresh_state)
    calls = _spy_rpcs(fresh)
    assert fresh_manager.load() is True
    assert fresh_state.step == 5
    # The load template (state_dict() of a container with no committed step) took no snapshot.
    assert "Snapshot" not in calls
    if mode == "snapshot":
        assert "Restore" in calls
    train(fresh_model, fresh, W, range(6, 11))
    ref_model, ref_opt = reference(W, build_wide, 10)
    assert mismatches(fresh_model, fresh, ref_model, ref_opt) == []
    fresh_manager.close()
    fresh.close()


@pytest.mark.parametrize("left", ["kept", "torn"])
def test_snapshot_mode_load_into_a_reattached_trainer_is_bitwise(
    start_server, gloo_one_rank, tmp_path, left
):
    """A restarted trainer reattaches to what the server kept of its predecessor (the moments
    of a later step than the checkpoint, or a torn state: it died mid-step), then torchtitan
    loads the checkpoint, calling state_dict() for a load template on a container that has
    committed steps, while the checkpoint's own snapshot may still be persisting."""
    server = start_server(chunk_bytes=CHUNK, persist_max_bandwidth="1M")
    model = build_wide(W)
    container = remote(W, model, server.address, "tt-restart", checkpoint="snapshot")
    state = TrainState()
    manager = _manager(tmp_path, model, container, state)
    train(model, container, W, range(1, 6))
    state.step = 5
    manager.save(curr_step=5)
    train(model, container, W, range(6, 8))
    if left == "torn":  # what a trainer killed while writing step 8 leaves: the writing mark
        container.segment.mapping.header[Word.WRITING_STEP] = 8 + 1
    manager.close()
    container.close(keep=True)  # the trainer process goes; the server keeps its segment

    fresh_model = build_wide(Workload(seed=7))
    fresh = remote(W, fresh_model, server.address, "tt-restart", checkpoint="snapshot")
    assert fresh.resumed_step == (7 if left == "kept" else None)
    fresh_state = TrainState()
    fresh_manager = _manager(tmp_path, fresh_model, fresh, fresh_state)
    assert fresh_manager.load() is True
    assert fresh_state.step == 5 and fresh.session.last_committed_step == 5
    train(fresh_model, fresh, W, range(6, 11))
    ref_model, ref_opt = reference(W, build_wide, 10)
    assert mismatches(fresh_model, fresh, ref_model, ref_opt) == []
    fresh_manager.close()
    fresh.close()


def test_snapshot_reference_loads_while_persisting_and_from_a_restarted_server(start_server):
    """A reference loaded at once, while its snapshot still persists, waits for it; after a
    server restart it restores from disk, and a state_dict() of the restored step refers to
    that snapshot again (nothing new is taken: the step exists on disk)."""
    first = start_server(chunk_bytes=CHUNK, persist_max_bandwidth="1M")
    model = build_wide(W)
    container = remote(W, model, first.address, "tt-ref", checkpoint="snapshot")
    train(model, container, W, range(1, 6))
    params_at_5 = params_copy(model)
    saved = container.state_dict()
    ref = saved[SNAPSHOT_REF_KEY]
    assert ref == "tt-ref/step-5" and saved[SNAPSHOT_JOB_KEY] == "tt-ref"
    assert container.client.snapshot_status(ref, 0).state == "persisting"
    container.close()

    again = build_wide(Workload(seed=7))
    again.load_state_dict(params_at_5)
    reloaded = remote(W, again, first.address, "tt-ref", checkpoint="snapshot")
    reloaded.load_state_dict(saved)
    train(again, reloaded, W, range(6, 11))
    ref_model, ref_opt = reference(W, build_wide, 10)
    assert mismatches(again, reloaded, ref_model, ref_opt) == []
    reloaded.close()
    first.kill()

    second = start_server(chunk_bytes=CHUNK, snapshot_dir=first.snapshot_dir)
    fresh = remote(W, build_wide(W), second.address, "tt-ref", checkpoint="snapshot")
    fresh.load_state_dict(saved)
    assert fresh.session.last_committed_step == 5
    calls = _spy_rpcs(fresh)
    assert fresh.state_dict()[SNAPSHOT_REF_KEY] == ref
    assert calls == []
    fresh.close()


def test_full_mode_load_template_does_not_write_under_a_persisting_snapshot(
    start_server, gloo_one_rank, tmp_path
):
    """Full mode: DCP loads into the tensors state_dict() returns, i.e. into the segment. A
    restarted trainer that reattaches while its predecessor's snapshot still persists must
    not let that load overwrite bytes the snapshot has yet to read."""
    server = start_server(chunk_bytes=CHUNK, persist_max_bandwidth=SLOW)
    model = build_wide(W)
    container = remote(W, model, server.address, "tt-full-restart", checkpoint="full")
    state = TrainState()
    manager = _manager(tmp_path, model, container, state)
    train(model, container, W, range(1, 6))
    state.step = 5
    manager.save(curr_step=5)
    train(model, container, W, range(6, 8))
    at_7 = record_state(model, container)
    snapshot_id = container.snapshot().snapshot_id
    manager.close()
    container.close(keep=True)

    fresh_model = build_wide(Workload(seed=7))
    fresh = remote(W, fresh_model, server.address, "tt-full-restart", checkpoint="full")
    assert fresh.resumed_step == 7
    handle = SnapshotHandle(snapshot_id, 7, 0, fresh.client)
    assert handle.status().state == "persisting"
    fresh_state = TrainState()
    fresh_manager = _manager(tmp_path, fresh_model, fresh, fresh_state)
    assert fresh_manager.load() is True
    status = handle.wait_durable(timeout_s=60)
    assert bitwise_diff(at_7, load_file(str(data_file(status.path)))) == []
    train(fresh_model, fresh, W, range(6, 11))
    ref_model, ref_opt = reference(W, build_wide, 10)
    assert mismatches(fresh_model, fresh, ref_model, ref_opt) == []
    fresh_manager.close()
    fresh.close()
