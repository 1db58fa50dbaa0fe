"""Shared training workload of the integration tests: a small model, deterministic data,
and a bitwise comparison against torch's own fused AdamW trained side by side."""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.nn as nn

from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer


@dataclasses.dataclass
class Workload:
    seed: int = 0
    steps: int = 10
    amsgrad: bool = False
    two_groups: bool = False
    weight_decay: float = 0.1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 24)
        self.head = nn.Linear(24, 6)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def build(w: Workload) -> Net:
    torch.manual_seed(w.seed)
    return Net()


def kwargs(w: Workload) -> dict:
    return dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=w.weight_decay, amsgrad=w.amsgrad)


def groups(w: Workload, model: Net):
    if not w.two_groups:
        return None
    return lambda m: [
        {"params": list(m.body.parameters()), "lr": 1e-2},
        {"params": list(m.head.parameters()), "lr": 3e-3},
    ]


def reference_optimizer(w: Workload, model: Net) -> torch.optim.AdamW:
    params = groups(w, model)(model) if w.two_groups else model.parameters()
    return torch.optim.AdamW(params, fused=True, **kwargs(w))


def remote(w: Workload, model: Net, server: str, job_id: str, **config) -> RemoteSwapOptimizersContainer:
    extra = {"param_groups": groups(w, model)} if w.two_groups else {}
    return RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, kwargs(w), 2, server=server, job_id=job_id,
        config=RemoteConfig(**config), **extra,
    )


def train(model: nn.Module, optimizer, w: Workload, steps: range) -> None:
    for step in steps:
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(w.seed * 1000 + step))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def mismatches(model: Net, container, ref_model: Net, ref_opt) -> list[str]:
    """Names of parameters/moments that differ bitwise from the reference."""
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if not torch.equal(p, q):
            bad.append(name)
        host = container.param_to_cpu_states_map[p]
        for key, value in ref_opt.state[q].items():
            if key == "step":
                if float(host["step"]) != float(value):
                    bad.append(f"{name}.step")
            elif not torch.equal(host[key], value):
                bad.append(f"{name}.{key}")
    return bad


def reference_mismatches(model: Net, container, w: Workload, steps: int = 10) -> list[str]:
    """``mismatches`` against an uninterrupted torch fused AdamW run of ``steps`` steps."""
    ref_model = build(w)
    ref = reference_optimizer(w, ref_model)
    train(ref_model, ref, w, range(1, steps + 1))
    return mismatches(model, container, ref_model, ref)


def parse_titan_toml(tmp_path, optimizer_toml: str):
    """torchtitan 0.2's JobConfig of a TOML with the custom config module and this
    ``[optimizer]`` section (parsed by torchtitan's own ConfigManager)."""
    from torchtitan.config import ConfigManager

    toml = tmp_path / "job.toml"
    toml.write_text(
        '[job]\ncustom_config_module = "swap_state.client.torchtitan_config"\n'
        f"[optimizer]\n{optimizer_toml}\n"
    )
    return ConfigManager().parse_args([f"--job.config_file={toml}"])


def main() -> None:
    """Subprocess entry: ``workload.py SERVER JOB RANK WORLD JSON`` prints a JSON result."""
    server, job, rank, world, spec = sys.argv[1:6]
    w = Workload(**json.loads(spec))
    model, ref_model = build(w), build(w)
    container = remote(w, model, server, job, rank=int(rank), world_size=int(world))
    ref = reference_optimizer(w, ref_model)
    train(model, container, w, range(1, w.steps + 1))
    train(ref_model, ref, w, range(1, w.steps + 1))
    result = {"mismatches": mismatches(model, container, ref_model, ref),
              "committed": container.session.last_committed_step}
    container.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
