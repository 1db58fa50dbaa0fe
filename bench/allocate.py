"""``python -m bench.allocate``: how fast a server creates segments (commit, map, mlock every
page), for one rank and for several ranks at once, through the real Attach/Allocate RPCs.

1. one rank allocating ``--size``;
2. ``--ranks`` ranks of one job allocating ``--size / --ranks`` each, all at once (threads,
   one channel each, as separate trainer processes would);
3. the same bytes written by ``memset`` into fresh anonymous memory in this process: the
   machine's own rate of touching new memory, a baseline (tmpfs commits pages by clearing
   them in the kernel, which can beat it).

Output under --out: allocate.md and allocate.json (raw samples included).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import mmap
import shutil
import sys
import tempfile
import time
from typing import Any

from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient

from bench import util
from bench.report import run_small_bench, small_bench_parser
from bench.util import fmt_bytes, summarize

__all__ = ["main"]

GiB = 1 << 30


def _parser() -> argparse.ArgumentParser:
    p = small_bench_parser("bench.allocate", __doc__, "allocate")
    p.add_argument("--size", default="4G", help="bytes of tensors allocated in all (K/M/G suffixes)")
    p.add_argument("--ranks", type=int, default=4, help="ranks allocating at once in section 2")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each section")
    return p


def _allocate(address: str, job: str, rank: int, world: int, nbytes: int) -> None:
    client = SwapStateClient(ClientConfig(address, timeout_s=600.0))
    try:
        session = client.attach(job, rank, world)
        session.allocate([("state.w.exp_avg", "float32", [nbytes // 4])])
        session.close(keep=False)
    finally:
        client.close()


def _ranks_at_once(address: str, job: str, ranks: int, nbytes: int) -> float:
    with concurrent.futures.ThreadPoolExecutor(ranks) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda r: _allocate(address, job, r, ranks, nbytes // ranks), range(ranks)))
        return time.perf_counter() - t0


def _memset_rate(nbytes: int) -> float:
    """Seconds to write ``nbytes`` of fresh anonymous memory once (page faults included)."""
    buffer = mmap.mmap(-1, nbytes)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    t0 = time.perf_counter()
    ctypes.memset(address, 1, nbytes)
    seconds = time.perf_counter() - t0
    del address
    buffer.close()
    return seconds


def measure(args) -> dict[str, Any]:
    nbytes = util.parse_size(args.size)
    shm_dir = tempfile.mkdtemp(prefix="swap-state-bench-alloc-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="swap-state-bench-alloc-")
    server = EmbeddedServer(EmbeddedServerConfig(shm_size_bytes=nbytes + (512 << 20), snapshot_dir=work,
                                                 auto_restart=False, server={"shm_dir": shm_dir, "cow_budget": 0})).start()
    seconds: dict[str, list[float]] = {"one_rank": [], "ranks_at_once": [], "memset": []}
    try:
        for rep in range(args.reps):
            t0 = time.perf_counter()
            _allocate(server.address, f"one-{rep}", 0, 1, nbytes)
            seconds["one_rank"].append(time.perf_counter() - t0)
            seconds["ranks_at_once"].append(_ranks_at_once(server.address, f"many-{rep}", args.ranks, nbytes))
            seconds["memset"].append(_memset_rate(nbytes))
    finally:
        server.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rates = {k: [nbytes / s / GiB for s in v] for k, v in seconds.items()}
    return {"bytes": nbytes, "ranks": args.ranks, "cpus": util.cpu_count(), "seconds": seconds,
            "gib_per_s": {k: summarize(v) for k, v in rates.items()}}


def markdown(result: dict[str, Any]) -> str:
    g = result["gib_per_s"]
    rows = [("one rank", "one_rank"), (f"{result['ranks']} ranks at once (together)", "ranks_at_once"),
            ("memset of as much fresh anonymous memory (this process)", "memset")]
    lines = [f"# Segment creation ({fmt_bytes(result['bytes'])} in all, {result['cpus']} CPUs)", "",
             "| what | n | GiB/s median | mean | worst |", "| --- | --- | --- | --- | --- |"]
    for label, key in rows:
        v = g[key]
        lines.append(f"| {label} | {v['n']} | {v['median']:.2f} | {v['mean']:.2f} | {v['min']:.2f} |")
    together = g["ranks_at_once"]["median"] / g["one_rank"]["median"]
    ceiling = g["one_rank"]["median"] / g["memset"]["median"]
    lines += ["", f"{result['ranks']} ranks at once ÷ one rank (medians): {together:.2f}; one rank ÷ "
              f"memset: {ceiling:.2f}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_small_bench(argv, _parser(), measure, markdown, "allocate")


if __name__ == "__main__":
    sys.exit(main())
