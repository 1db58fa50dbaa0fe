"""FSDP2 on 2 ranks (gloo, CPU, one process per rank): a plain torch AdamW checkpoint, written
by torchtitan's CheckpointManager, resumes under swap-state through CheckpointManager's strict
``dcp.load`` (the local container, and the remote one in "snapshot" mode, whose load of a plain
checkpoint takes the moments from it), bitwise equal on every rank's shards to continuing with
plain AdamW.

The ranks run in a subprocess (``python this_file.py SERVER FOLDER``) under a timeout; this
file imports nothing relative at the top so that it runs as a script.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORLD = 2
SAVED_AT, LAST = 3, 6
KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": True}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 24)
        self.head = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def test_fsdp2_plain_checkpoint_resumes_under_swap_state_on_two_ranks(start_server, tmp_path):
    server = start_server()
    proc = subprocess.run(
        [sys.executable, __file__, server.address, str(tmp_path)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["sharded"], result
        assert result["mismatches"] == {"local": [], "snapshot": []}, result


# -- the ranks -------------------------------------------------------------------------------


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict) -> None:
        self.step = int(state_dict["step"])


def _manager(folder, model, optimizers, state):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import Checkpoint as CheckpointConfig

    config = CheckpointConfig(enable=True, folder="checkpoint", interval=1, async_mode="disabled", keep_latest_k=0)
    return CheckpointManager(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
        states={"train_state": state}, checkpoint_config=config, sd_adapter=None, base_folder=folder,
    )  # fmt: skip


def _train(model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(rank * 1000 + step))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def init_ranks(rank: int, port: int, world: int = WORLD, net: type[nn.Module] = Net):
    """Join the gloo group of ``world`` ranks; ``build(seed)``: a ``net`` sharded with FSDP2."""
    import faulthandler

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import swap_state.client.torchtitan.config  # noqa: F401  (the CheckpointManager hooks)

    faulthandler.enable(all_threads=True)  # a native abort in a rank prints every thread's Python stack
    # The CPUs shared out: more torch threads than CPUs spin in OpenMP's barriers.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = net()
        fully_shard(model, mesh=mesh)
        return model

    return build


def shard_mismatches(model, container, reference_model, reference_optimizer) -> list[str]:
    """This rank's parameters and moments that differ bitwise from the reference's."""
    bad = []
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        if not torch.equal(_local(p), _local(q)):
            bad.append(name)
        host = container.param_to_cpu_states_map[p]
        for key, value in reference_optimizer.state[q].items():
            if not torch.equal(host[key].reshape(_local(value).shape), _local(value)):
                bad.append(f"{name}.{key}")
    return bad


def _rank_main(rank: int, port: int, server: str, folder: str) -> None:
    import torch.distributed as dist
    from torchtitan.components.optimizer import OptimizersContainer

    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
    from swap_state.client.optim.container import SwapOptimizersContainer

    build = init_ranks(rank, port)
    model = build(0)
    plain = OptimizersContainer([model], torch.optim.AdamW, dict(KWARGS))
    state = _TrainState()
    manager = _manager(folder, model, plain, state)
    _train(model, plain, rank, range(1, SAVED_AT + 1))
    state.step = SAVED_AT
    manager.save(curr_step=SAVED_AT)
    manager.close()
    _train(model, plain, rank, range(SAVED_AT + 1, LAST + 1))  # the reference: plain AdamW goes on
    reference = plain.optimizers[0]

    mismatches: dict[str, list[str]] = {}
    for kind in ("local", "snapshot"):
        fresh = build(7)
        if kind == "local":
            container = SwapOptimizersContainer([fresh], torch.optim.AdamW, dict(KWARGS), 2)
        else:
            container = RemoteSwapOptimizersContainer(
                [fresh], torch.optim.AdamW, dict(KWARGS), 2, server=server, job_id="fsdp2",
                config=RemoteConfig(checkpoint="snapshot"),
            )  # fmt: skip
        fresh_state = _TrainState()
        fresh_manager = _manager(folder, fresh, container, fresh_state)
        assert fresh_manager.load(step=SAVED_AT) and fresh_state.step == SAVED_AT
        _train(fresh, container, rank, range(SAVED_AT + 1, LAST + 1))
        mismatches[kind] = shard_mismatches(fresh, container, model, reference)
        fresh_manager.close()
        if kind != "local":
            container.close()
    sharded = all(_local(p).shape[0] < p.shape[0] for p in model.parameters())
    with open(os.path.join(folder, f"rank-{rank}.json"), "w") as f:
        json.dump({"mismatches": mismatches, "sharded": sharded}, f)
    dist.destroy_process_group()


def spawn_ranks(rank_main, argv: list[str]) -> None:
    """``rank_main(rank, port, SERVER, FOLDER)`` in ``WORLD`` spawned processes, from
    ``argv = [script, SERVER, FOLDER]``."""
    import torch.multiprocessing as mp

    server, folder = argv[1:3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(port, server, folder), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    spawn_ranks(_rank_main, sys.argv)
