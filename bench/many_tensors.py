"""``python -m bench.many_tensors``: whether a step and a snapshot cost the same at 200 or
6,000 tensors (MoE experts, per-layer norms): the remote container's optimizer step against
plain fused AdamW over the same parameters, and ``snapshot()``'s stall, at several counts.

Per count N: N parameters of ``--shape`` (small: the per-tensor costs dominate), two models
with the same values and gradients; plain ``AdamW(fused=True)`` and
``RemoteSwapOptimizersContainer`` (one embedded server) step in interleaved rounds (gradients
set, no forward: the optimizer step alone). Then ``--snapshots`` snapshots, one per step: the
first carries the metadata base (once per session), the others only the delta.

Output under --out: many-tensors.md and many-tensors.json (raw samples included).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from swap_state.client.device import DeviceBackend
from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig

from bench import util
from bench.report import run_small_bench, small_bench_parser
from bench.util import fmt_ms, summarize

__all__ = ["main"]

_ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "fused": True}


def _parser() -> argparse.ArgumentParser:
    p = small_bench_parser("bench.many_tensors", __doc__, "many-tensors")
    p.add_argument("--counts", default="200,2000,6000", help="comma-separated parameter counts")
    p.add_argument("--shape", default="64x33", help="every parameter's shape, RxC")
    p.add_argument("--steps", type=int, default=20, help="timed steps per optimizer and count")
    p.add_argument("--snapshots", type=int, default=6, help="snapshots per count (the first sends the base)")
    return p


class _Params(nn.Module):
    def __init__(self, count: int, shape: tuple[int, int], seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.p = nn.ParameterList(nn.Parameter(torch.randn(*shape, generator=generator)) for _ in range(count))

    def set_grads(self, step: int) -> None:
        for index, param in enumerate(self.p):
            param.grad = torch.full_like(param, 1e-3 * ((index + step) % 7 + 1))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _one_count(count: int, shape: tuple[int, int], args, address: str) -> dict[str, Any]:
    plain_model, remote_model = _Params(count, shape), _Params(count, shape)
    plain = torch.optim.AdamW(plain_model.parameters(), **_ADAMW)
    remote = RemoteSwapOptimizersContainer(
        [remote_model], torch.optim.AdamW, dict(_ADAMW), 1, server=address, job_id=f"many-{count}",
        config=RemoteConfig(rpc_timeout_s=120.0), device_backend=DeviceBackend("cpu"))
    samples: dict[str, list[float]] = {"plain": [], "remote": [], "snapshot_first": [], "snapshot": []}
    try:
        for step in range(args.steps + 1):  # the first step of each is a warm-up
            plain_model.set_grads(step)
            remote_model.set_grads(step)
            t_plain, t_remote = _timed(plain.step), _timed(remote.step)
            if step:
                samples["plain"].append(t_plain)
                samples["remote"].append(t_remote)
        same = all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), remote_model.parameters()))
        for index in range(args.snapshots):
            remote_model.set_grads(args.steps + 1 + index)
            remote.step()
            t0 = time.perf_counter()
            handle = remote.snapshot()
            samples["snapshot_first" if index == 0 else "snapshot"].append(time.perf_counter() - t0)
            handle.wait_durable(timeout_s=120)
    finally:
        remote.close()
    return {"count": count, "bitwise_equal": same, "samples": samples,
            "summary": {k: summarize(v) for k, v in samples.items()}}


def measure(args) -> dict[str, Any]:
    shape = tuple(int(d) for d in args.shape.lower().split("x"))
    counts = [int(c) for c in args.counts.split(",")]
    shm_dir = tempfile.mkdtemp(prefix="swap-state-bench-many-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="swap-state-bench-many-")
    largest = max(counts) * shape[0] * shape[1] * 4
    server = EmbeddedServer(EmbeddedServerConfig(shm_size_bytes=4 * largest + (256 << 20), server={"shm_dir": shm_dir},
                                                 snapshot_dir=work, auto_restart=False)).start()
    try:
        rows = [_one_count(count, shape, args, server.address) for count in counts]
    finally:
        server.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"shape": list(shape), "cpus": util.cpu_count(), "torch_threads": torch.get_num_threads(), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    shape = "x".join(str(d) for d in result["shape"])
    lines = [f"# A step and a snapshot at many tensors ({shape} each, {result['cpus']} CPUs)", "",
             "| tensors | plain fused AdamW: median / mean / worst | remote: median / mean / worst | "
             "remote ÷ plain (medians, means) | snapshot() stall: median / mean / worst | first snapshot() "
             "(sends the base) | bitwise equal |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        s = row["summary"]
        p, r, snap = s["plain"], s["remote"], s["snapshot"]

        def three(v):
            return f"{fmt_ms(v['median'])} / {fmt_ms(v['mean'])} / {fmt_ms(v['max'])}"

        lines.append(f"| {row['count']} | {three(p)} | {three(r)} | {r['median'] / p['median']:.2f}x, "
                     f"{r['mean'] / p['mean']:.2f}x | {three(snap)} | {fmt_ms(s['snapshot_first']['median'])} | "
                     f"{'yes' if row['bitwise_equal'] else '**no**'} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    return run_small_bench(argv, _parser(), measure, markdown, "many-tensors")


if __name__ == "__main__":
    sys.exit(main())
