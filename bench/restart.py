"""``python -m bench.restart``: what a server restart under a training job costs it, each number
beside its baseline from the same run.

1. step time: steps while the server is up, against steps while it is gone (killed);
2. server start: a server adopting the job's segment (after SIGKILL, and after SIGTERM: its
   stop included) against a server starting on an empty shm directory, same flags;
3. reconnect: from the new server serving to the trainer's session being live again.

Output under --out: restart.md (a table) and restart.json (everything, raw samples included).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.common.retry import wait_until

from bench import util  # noqa: F401 (parse_size)
from bench.cli import _isolate
from bench.report import run_small_bench, small_bench_parser
from bench.util import fmt_bytes, fmt_ms, summarize
from bench.workload import build_model, build_variant

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = small_bench_parser("bench.restart", __doc__, "restart")
    p.add_argument("--params", default="32M", help="model parameters (the segment holds 8 bytes of moments each)")
    p.add_argument("--steps", type=int, default=20, help="timed steps with the server up, and as many without")
    p.add_argument("--reps", type=int, default=3, help="restarts of each kind (and fresh starts)")
    p.add_argument("--isolate", action="store_true", help="pin each server to the last CPU and the trainer "
                   "(torch threads to match) to the others, as on a host where the server has cores of its own")
    return p


def _server(shm_dir: str, snapshot_dir: str, shm_size: int) -> EmbeddedServer:
    return EmbeddedServer(EmbeddedServerConfig(
        shm_size_bytes=shm_size, snapshot_dir=snapshot_dir, auto_restart=False,
        server={"shm_dir": shm_dir, "free_segments_on_stop": False, "chunk_bytes": 64 << 20},
    )).start()


_CPUS = sorted(os.sched_getaffinity(0))  # at import: before anything is pinned


def _pinned(args, server: EmbeddedServer) -> None:
    """With --isolate: the (new) server process on the last CPU, the trainer on the rest."""
    if args.isolate:
        _isolate(server.pid, _CPUS[-1:], _CPUS[:-1])


def _steps(variant, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        variant.model(variant.x).square().mean().backward()
        variant.optimizer.step()
        variant.optimizer.zero_grad()
        out.append(time.perf_counter() - t0)
    return out


def _timed(action) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def measure(args) -> dict[str, Any]:
    params = util.parse_size(args.params)
    shm_dir = tempfile.mkdtemp(prefix="swap-state-bench-restart-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="swap-state-bench-restart-")
    shm_size = 12 * params + (256 << 20)
    samples: dict[str, list[float]] = {k: [] for k in (
        "step_up_s", "step_gone_s", "fresh_start_s", "adopt_after_kill_s", "stop_and_adopt_s",
        "reconnect_s")}
    server = _server(shm_dir, work, shm_size)
    _pinned(args, server)
    try:
        base = build_model(params, torch.device("cpu"))
        variant = build_variant("remote", base, 8, torch.device("cpu"), 4, server=server.address, job_id="restart")
        session = variant.optimizer.session
        segment_bytes = os.path.getsize(session.segment.path)
        _steps(variant, 3)  # warm-up
        for _ in range(args.reps):
            samples["step_up_s"] += _steps(variant, args.steps // args.reps)
            server.kill()
            wait_until(session.server_gone, timeout_s=30)
            samples["step_gone_s"] += _steps(variant, args.steps // args.reps)
            samples["adopt_after_kill_s"].append(_timed(server.restart))
            _pinned(args, server)
            t0 = time.perf_counter()
            wait_until(lambda: not session.server_gone(), timeout_s=30, first_s=0.001, max_s=0.005)
            samples["reconnect_s"].append(time.perf_counter() - t0)
            samples["stop_and_adopt_s"].append(_timed(server.restart))  # SIGTERM, then a new one
            _pinned(args, server)
            wait_until(lambda: not session.server_gone(), timeout_s=30)
        stats = variant.optimizer.client.stats()
        reconnects = stats.reconnects_total
        variant.optimizer.close()
        for _ in range(args.reps):  # the baseline: the same server on an empty shm directory
            empty = tempfile.mkdtemp(prefix="swap-state-bench-empty-", dir="/dev/shm")
            t0 = time.perf_counter()
            fresh = _server(empty, work, shm_size)
            samples["fresh_start_s"].append(time.perf_counter() - t0)
            fresh.stop()
            shutil.rmtree(empty, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"params": params, "segment_bytes": segment_bytes, "reconnects_total_last_server": reconnects,
            "cpus": len(_CPUS), "isolated": args.isolate, "samples": samples, "summary": {k: summarize(v) for k, v in samples.items()}}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows = [("step, server up", "step_up_s"), ("step, server gone", "step_gone_s"),
            ("start on an empty shm dir (baseline)", "fresh_start_s"),
            ("start adopting the segment (after SIGKILL)", "adopt_after_kill_s"),
            ("SIGTERM stop + start adopting", "stop_and_adopt_s"),
            ("trainer reconnected after the new server serves", "reconnect_s")]
    how = "server on its own CPU" if result["isolated"] else "CPUs shared by trainer and server"
    lines = [f"# Server restart under training ({fmt_bytes(result['segment_bytes'])} segment, "
             f"{result['cpus']} CPUs, {how})", "",
             "| what | n | median | mean | worst |", "| --- | --- | --- | --- | --- |"]
    for label, key in rows:
        v = s[key]
        lines.append(f"| {label} | {v['n']} | {fmt_ms(v['median'])} | {fmt_ms(v['mean'])} | {fmt_ms(v['max'])} |")
    ratio = s["step_gone_s"]["median"] / s["step_up_s"]["median"]
    extra = s["adopt_after_kill_s"]["median"] - s["fresh_start_s"]["median"]
    lines += ["", f"Step time with the server gone / up (medians): {ratio:.2f}.",
              f"Adoption adds {fmt_ms(extra)} to a server start (medians; below zero: less than the "
              "noise of starting a Python process).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_small_bench(argv, _parser(), measure, markdown, "restart")


if __name__ == "__main__":
    sys.exit(main())
