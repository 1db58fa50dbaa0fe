"""``python -m bench.quiet_steps``: what whole-state mode costs a step that takes no snapshot,
against moments-only, in the same run (interleaved rounds, one server).

Three remote containers over copies of one model: moments only; whole state as it runs now
(the parameters copied only for a snapshot's step); and whole state copying the parameters
after every step, as it did before (``ModelArea.copy_from_model`` after each step, waited for
at once: on the CPU it was made in ``step()``): the cost the change removed.

Output under --out: quiet-steps.md and quiet-steps.json (raw samples included).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from swap_state.client.device import DeviceBackend
from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig

from bench import util
from bench.report import run_small_bench, small_bench_parser
from bench.util import fmt_bytes, fmt_ms, summarize
from bench.workload import ADAMW_KWARGS, build_model

__all__ = ["main"]

VARIANTS = ("moments_only", "whole_state", "whole_state_copy_every_step")


def _parser() -> argparse.ArgumentParser:
    p = small_bench_parser("bench.quiet_steps", __doc__, "quiet-steps")
    p.add_argument("--params", default="32M", help="model parameters")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    p.add_argument("--block", type=int, default=3, help="steps per variant per round")
    return p


def _container(base, name: str, address: str):
    model = copy.deepcopy(base)
    config = RemoteConfig(snapshot_model=name != "moments_only", rpc_timeout_s=60.0)
    optimizer = RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, dict(ADAMW_KWARGS), 4, server=address, job_id=name, config=config,
        device_backend=DeviceBackend("cpu"))
    x = torch.randn(8, model.layers[0].in_features, generator=torch.Generator().manual_seed(1))
    return model, optimizer, x


def _step(name: str, model, optimizer, x) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if name == "whole_state_copy_every_step":  # what every step did before, in step()
        optimizer.segment.model_area.copy_from_model(optimizer.session.last_committed_step)
        optimizer.segment.model_area.wait_copy()  # on the CPU the copy was made at once


def measure(args) -> dict[str, Any]:
    params = util.parse_size(args.params)
    shm_dir = tempfile.mkdtemp(prefix="swap-state-bench-quiet-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="swap-state-bench-quiet-")
    server = EmbeddedServer(EmbeddedServerConfig(shm_size_bytes=40 * params + (256 << 20), server={"shm_dir": shm_dir},
                                                 snapshot_dir=work, auto_restart=False)).start()
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        base = build_model(params, torch.device("cpu"))
        variants = {name: _container(base, name, server.address) for name in VARIANTS}
        for name, parts in variants.items():
            _step(name, *parts)  # warm-up
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]  # drift hits every variant alike
            for name in order:
                for _ in range(args.block):
                    t0 = time.perf_counter()
                    _step(name, *variants[name])
                    samples[name].append(time.perf_counter() - t0)
        for _, optimizer, _ in variants.values():
            optimizer.close()
    finally:
        server.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"params": params, "model_bytes": params * 4, "cpus": util.cpu_count(), "samples": samples,
            "summary": {k: summarize(v) for k, v in samples.items()}}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    base = s["moments_only"]
    lines = [f"# Quiet steps in whole-state mode ({fmt_bytes(result['model_bytes'])} of parameters, "
             f"{result['cpus']} CPUs)", "",
             "| variant | n | median | mean | worst | median ÷ moments-only | mean ÷ moments-only |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in VARIANTS:
        v = s[name]
        lines.append(f"| {name} | {v['n']} | {fmt_ms(v['median'])} | {fmt_ms(v['mean'])} | {fmt_ms(v['max'])} | "
                     f"{v['median'] / base['median']:.3f} | {v['mean'] / base['mean']:.3f} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    return run_small_bench(argv, _parser(), measure, markdown, "quiet-steps")


if __name__ == "__main__":
    sys.exit(main())
