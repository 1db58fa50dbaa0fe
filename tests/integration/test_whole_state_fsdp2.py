"""Whole-state snapshots under FSDP2 on 2 ranks (gloo, CPU, one process per rank), through the
Python API and torchtitan's CheckpointManager: the checkpoint refers to one snapshot per rank
holding that rank's parameter and moment shards (DTensor global shape and offsets in the
manifest); a fresh model loads it (the parameters come back from the server into the DTensor
shards) and trains on bitwise equal to plain AdamW continuing; ``swap-state export --format
torchtitan`` assembles the shards into the full parameters.

The ranks run in a subprocess (``python this_file.py SERVER FOLDER``) under a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORLD = 2
SAVED_AT, LAST = 3, 6
JOB = "fsdp2-whole"


def test_fsdp2_whole_state_snapshot_checkpoint_resumes_bitwise_and_exports(start_server, tmp_path):
    from safetensors.torch import load_file

    from snapshot_kit import swap_state_cli

    snapshots = tmp_path / "snapshots"
    server = start_server(snapshot_dir=snapshots)
    proc = subprocess.run(
        [sys.executable, __file__, server.address, str(tmp_path)], capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    full = {}
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["sharded"] and result["mismatches"] == [], result
        full = result["full_at_save"]
    step_dir = next(snapshots.glob(f"{JOB}/step-*{SAVED_AT}"))
    manifest = json.loads((step_dir / "rank-00001.manifest.json").read_text())
    body = next(t for t in manifest["tensors"] if t["name"] == "model.body.weight")
    assert body["key"] == "param" and body["global_shape"] == [24, 12] and body["global_offset"] == [12, 0]
    assert load_file(str(step_dir / "rank-00001.safetensors"))["model.body.weight"].shape == (12, 12)

    out = tmp_path / "plain" / f"step-{SAVED_AT}"
    checkpoint = tmp_path / "checkpoint" / f"step-{SAVED_AT}"
    exported = swap_state_cli("export", "--format", "torchtitan", str(checkpoint), str(out), "--snapshot-dir", str(snapshots))
    assert exported.returncode == 0, exported.stderr
    assert "ranks [0, 1]" in exported.stdout
    from swap_state.client.export.torchtitan import read_checkpoint

    plain = read_checkpoint(out)
    for name, values in full.items():
        assert torch.equal(plain[name], torch.tensor(values)), name  # the whole tensor, both shards
    assert plain["optimizer"]["state.body.weight.exp_avg"].shape == (24, 12)


# -- the ranks -------------------------------------------------------------------------------


def _rank_main(rank: int, port: int, server: str, folder: str) -> None:
    import torch.distributed as dist
    from torchtitan.components.optimizer import OptimizersContainer

    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
    from test_titan_fsdp2 import KWARGS, _TrainState, _local, _manager, _train, init_ranks, shard_mismatches

    build = init_ranks(rank, port)
    reference = build(0)
    plain = OptimizersContainer([reference], torch.optim.AdamW, dict(KWARGS))
    _train(reference, plain, rank, range(1, SAVED_AT + 1))
    full_at_save = {k: v.full_tensor().tolist() for k, v in reference.state_dict().items()}
    _train(reference, plain, rank, range(SAVED_AT + 1, LAST + 1))

    model = build(0)
    config = RemoteConfig(checkpoint="snapshot", job_id=JOB)
    container = RemoteSwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2, server=server, config=config)
    state = _TrainState()
    manager = _manager(folder, model, container, state)
    _train(model, container, rank, range(1, SAVED_AT + 1))
    state.step = SAVED_AT
    manager.save(curr_step=SAVED_AT)
    manager.close()  # waits until the snapshot is durable
    container.close()

    fresh = build(7)  # other weights: the load must replace them
    container = RemoteSwapOptimizersContainer([fresh], torch.optim.AdamW, dict(KWARGS), 2, server=server, config=config)
    fresh_state = _TrainState()
    fresh_manager = _manager(folder, fresh, container, fresh_state)
    assert fresh_manager.load(step=SAVED_AT) and fresh_state.step == SAVED_AT
    _train(fresh, container, rank, range(SAVED_AT + 1, LAST + 1))
    bad = shard_mismatches(fresh, container, reference, plain.optimizers[0])
    fresh_manager.close()
    container.close()
    sharded = all(_local(p).shape[0] < p.shape[0] for p in reference.parameters())
    with open(os.path.join(folder, f"rank-{rank}.json"), "w") as f:
        json.dump({"mismatches": bad, "sharded": sharded, "full_at_save": full_at_save}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from test_titan_fsdp2 import spawn_ranks

    spawn_ranks(_rank_main, sys.argv)
