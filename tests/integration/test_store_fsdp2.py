"""Resume anywhere, FSDP2 on gloo ranks (CPU, one process per rank) through torchtitan's
CheckpointManager, with whole-state snapshot-mode checkpoints and a store every host reaches.

Two real server processes stand for two hosts (ranks 0-1 on host a, 2-3 on host b), each with
its own shm and snapshot directories, one store (a directory standing for a shared
filesystem). 4 ranks train 3 steps and save; plain torchtitan (AdamW, DCP) saves the same
steps beside it. Then:

1. host b is lost (server stopped, directories deleted); its ranks resume on a new host c from
   the store, the job trains on to step 6 bitwise equal to plain AdamW uninterrupted;
2. the job resumes at 2 ranks, and at 3 (uneven shards, an empty one at 4 ranks): right after
   the load every shard (parameters, moments, steps) is bitwise the one DCP resharded from
   plain torchtitan's checkpoint, and 3 more steps stay bitwise equal to plain torchtitan
   resuming its own checkpoint at that world size.

The ranks run in subprocesses (``python this_file.py SPEC_JSON``) under a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import pathlib

import pytest
import torch
import torch.nn as nn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SAVED_AT, LAST = 3, 6
JOB = "anywhere"


class UnevenNet(nn.Module):
    """Row counts no world size here divides: 26 rows shard 7,7,7,5 on 4 ranks and 9,9,8 on
    3; 5 rows shard 2,2,1,0 on 4 (an empty shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 26)
        self.head = nn.Linear(26, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _run_ranks(spec: dict, timeout: float = 240) -> list[dict]:
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    folder = pathlib.Path(spec["folder"])
    results = [json.loads((folder / f"{spec['phase']}-rank-{r}.json").read_text()) for r in range(spec["world"])]
    return results


def test_fsdp2_job_loses_a_host_and_resumes_elsewhere_and_at_2_and_3_ranks(start_server, tmp_path):
    store = tmp_path / "store"
    shm_root = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-hosts-", dir="/dev/shm"))
    try:
        def host(name: str):
            (shm_root / name).mkdir()
            return start_server(snapshot_dir=tmp_path / f"{name}-snapshots", shm_dir=str(shm_root / name),
                                snapshot_store=str(store))

        a, b = host("a"), host("b")
        base = {"folder": str(tmp_path), "job": JOB}
        saved = _run_ranks({**base, "phase": "save", "world": 4, "servers": [a.address] * 2 + [b.address] * 2})
        assert all(r["stored"] for r in saved), saved
        assert any(r["empty_shard"] for r in saved), "the 4-rank layout must have an empty shard"

        b.stop()  # host b is lost, its disks with it
        shutil.rmtree(tmp_path / "b-snapshots")
        shutil.rmtree(shm_root / "b")
        c = host("c")
        lost = _run_ranks({**base, "phase": "host-lost", "world": 4, "servers": [a.address] * 2 + [c.address] * 2})
        assert all(r["mismatches"] == [] for r in lost), lost
        assert "source=store" in c.log_text()

        for world in (2, 3):
            resumed = _run_ranks({**base, "phase": f"reshard-{world}", "world": world,
                                  "servers": [a.address] * (world - 1) + [c.address]})
            for rank, result in enumerate(resumed):
                assert result["at_load"] == [] and result["after_training"] == [], (world, rank, result)
        assert "snapshot_world_size=4" in c.log_text() and "snapshot_world_size=4" in a.log_text()
        # Planned from the step's layout index, which the host that published the step built
        # from every rank's manifest in the store (neither host held the whole job).
        assert "plan=layout-index" in c.log_text() and "plan=every-manifest" not in c.log_text()
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


# -- the ranks -------------------------------------------------------------------------------


def _container(model, spec: dict, rank: int):
    """A swap-state container on this rank's host's server (its ranks there: local_world_size)."""
    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
    from test_titan_fsdp2 import KWARGS

    server = spec["servers"][rank]
    config = RemoteConfig(checkpoint="snapshot", job_id=JOB, local_world_size=spec["servers"].count(server))
    return RemoteSwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2, server=server, config=config)


def _plain(model):
    from torchtitan.components.optimizer import OptimizersContainer
    from test_titan_fsdp2 import KWARGS

    return OptimizersContainer([model], torch.optim.AdamW, dict(KWARGS))


def _managers(folder: str, model, optimizers, plain_model, plain):
    from test_titan_fsdp2 import _manager, _TrainState

    state, plain_state = _TrainState(), _TrainState()
    return (_manager(os.path.join(folder, "swap"), model, optimizers, state), state,
            _manager(os.path.join(folder, "plain"), plain_model, plain, plain_state), plain_state)


def _phase_save(rank: int, build, spec: dict) -> dict:
    from test_titan_fsdp2 import _local, _train

    model, plain_model = build(0), build(0)
    container, plain = _container(model, spec, rank), _plain(plain_model)
    manager, state, plain_manager, plain_state = _managers(spec["folder"], model, container, plain_model, plain)
    _train(model, container, rank, range(1, SAVED_AT + 1))
    _train(plain_model, plain, rank, range(1, SAVED_AT + 1))
    state.step = plain_state.step = SAVED_AT
    manager.save(curr_step=SAVED_AT)
    plain_manager.save(curr_step=SAVED_AT)
    container.wait_checkpoint_stored(timeout_s=120)
    manager.close()
    plain_manager.close()
    container.close()
    empty = any(_local(p).numel() == 0 for p in model.parameters())
    return {"stored": True, "empty_shard": empty}


def _phase_host_lost(rank: int, build, spec: dict) -> dict:
    """Every rank resumes (ranks 2 and 3 on the new host, from the store) and trains on."""
    from test_titan_fsdp2 import _train, shard_mismatches

    reference, plain = build(0), None
    plain = _plain(reference)
    _train(reference, plain, rank, range(1, LAST + 1))  # uninterrupted plain AdamW
    model = build(7)  # other weights: the load must replace them
    container = _container(model, spec, rank)
    manager, state, _, _ = _managers(spec["folder"], model, container, build(0), _plain(build(0)))
    assert manager.load(step=SAVED_AT) and state.step == SAVED_AT
    _train(model, container, rank, range(SAVED_AT + 1, LAST + 1))
    bad = shard_mismatches(model, container, reference, plain.optimizers[0])
    manager.close()
    container.close()
    return {"mismatches": bad}


def _phase_reshard(rank: int, build, spec: dict) -> dict:
    """Resume at this world size: swap-state from its snapshots, plain torchtitan from DCP."""
    from test_titan_fsdp2 import _train, shard_mismatches

    model, plain_model = build(7), build(8)
    container, plain = _container(model, spec, rank), _plain(plain_model)
    manager, state, plain_manager, plain_state = _managers(spec["folder"], model, container, plain_model, plain)
    assert manager.load(step=SAVED_AT) and state.step == SAVED_AT
    assert plain_manager.load(step=SAVED_AT) and plain_state.step == SAVED_AT
    at_load = shard_mismatches(model, container, plain_model, plain.optimizers[0])
    _train(model, container, rank, range(SAVED_AT + 1, LAST + 1))
    _train(plain_model, plain, rank, range(SAVED_AT + 1, LAST + 1))
    after = shard_mismatches(model, container, plain_model, plain.optimizers[0])
    manager.close()
    plain_manager.close()
    container.close()
    return {"at_load": at_load, "after_training": after}


def _rank_main(rank: int, port: int, spec_json: str) -> None:
    import torch.distributed as dist
    from test_titan_fsdp2 import init_ranks

    spec = json.loads(spec_json)
    build = init_ranks(rank, port, spec["world"], UnevenNet)
    phase = spec["phase"]
    run = {"save": _phase_save, "host-lost": _phase_host_lost}.get(phase, _phase_reshard)
    result = run(rank, build, spec)
    with open(os.path.join(spec["folder"], f"{phase}-rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    world = json.loads(sys.argv[1])["world"]
    mp.start_processes(_rank_main, args=(free_port, sys.argv[1]), nprocs=world, start_method="spawn")
