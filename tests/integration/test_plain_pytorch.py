"""A plain PyTorch trainer (FSDP2 on 2 gloo ranks; torchtitan and numpy, which the client extra
does not install, blocked from import) steps,
snapshots and restores with ``RemoteSwapOptimizersContainer`` on a real server, bitwise equal
to ``torch.optim.AdamW`` on an identical model: after training, after a restore of an earlier
snapshot, and after training on from it.

The ranks run in subprocesses (``python this_file.py SPEC_JSON``) under a timeout.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORLD, SNAPSHOT_AT, LAST = 2, 2, 4
KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8, "fused": True}


def test_a_plain_fsdp2_loop_without_torchtitan_steps_snapshots_and_restores_bitwise(start_server, tmp_path):
    server = start_server()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = {"server": server.address, "folder": str(tmp_path)}
    ranks = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ranks.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=180)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0] * WORLD, "\n".join(out[-4000:] for out in outputs)
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["torchtitan_imported"] is False
        assert result["restored_step"] == SNAPSHOT_AT
        assert result["after_training"] == [] and result["after_restore"] == [] and result["after_resume"] == []
        assert result["compared"] > 0


# -- the ranks -------------------------------------------------------------------------------


#: What the client extra does not install (numpy came with torchtitan).
ABSENT = ("torchtitan", "numpy")


def _mismatches(model, ref, container, ref_optimizer) -> list[str]:
    """Every parameter and moment shard of this rank that is not bitwise the reference's."""
    import torch

    flat = container.state_dict()
    found = []
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not torch.equal(param.to_local(), ref_param.to_local()):
            found.append(name)
        for key in ("exp_avg", "exp_avg_sq"):
            ours = flat[f"state.{name}.{key}"].to_local()
            if not torch.equal(ours, ref_optimizer.state[ref_param][key].to_local()):
                found.append(f"{name}.{key}")
    return found


def _train(model, optimizer, rank: int, steps: range) -> None:
    import torch

    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=generator)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _rank_main(spec: dict) -> None:
    for name in ABSENT:
        sys.modules[name] = None  # import raises ModuleNotFoundError, find_spec says None: absent
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from swap_state.client import RemoteConfig, RemoteSwapOptimizersContainer

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 30), nn.Tanh(), nn.Linear(30, 5))
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    config = RemoteConfig(job_id="plain-fsdp2", local_world_size=WORLD)
    container = RemoteSwapOptimizersContainer([model], torch.optim.AdamW, dict(KWARGS), 2,
                                              server=spec["server"], config=config)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), **KWARGS)

    _train(model, container, rank, range(1, SNAPSHOT_AT + 1))
    _train(ref, ref_optimizer, rank, range(1, SNAPSHOT_AT + 1))
    handle = container.snapshot()
    handle.wait_durable(timeout_s=120)
    saved_params = [p.detach().clone() for p in model.parameters()]
    saved_ref = (copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_optimizer.state_dict()))
    _train(model, container, rank, range(SNAPSHOT_AT + 1, LAST + 1))
    _train(ref, ref_optimizer, rank, range(SNAPSHOT_AT + 1, LAST + 1))
    after_training = _mismatches(model, ref, container, ref_optimizer)

    # Back to the snapshot: the moments from the server, the parameters from the trainer's own copy.
    restored_step = container.restore(handle.snapshot_id)
    with torch.no_grad():
        for param, saved in zip(model.parameters(), saved_params, strict=True):
            param.copy_(saved)
    ref.load_state_dict(saved_ref[0])
    ref_optimizer.load_state_dict(saved_ref[1])
    after_restore = _mismatches(model, ref, container, ref_optimizer)
    _train(model, container, rank, range(SNAPSHOT_AT + 1, LAST + 1))
    _train(ref, ref_optimizer, rank, range(SNAPSHOT_AT + 1, LAST + 1))
    result = {
        "torchtitan_imported": any(module is not None and name.split(".")[0] in ABSENT
                                   for name, module in sys.modules.items()),
        "restored_step": restored_step, "after_training": after_training, "after_restore": after_restore,
        "after_resume": _mismatches(model, ref, container, ref_optimizer),
        "compared": 2 * len(list(model.parameters())),
    }
    container.close()
    dist.destroy_process_group()
    pathlib.Path(spec["folder"], f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
