"""``python -m bench.allocate``: how fast a server creates segments (commit, map, mlock every
page), for one rank and for several ranks at once, through the real Attach/Allocate RPCs.

1. one rank allocating ``--size``;
2. ``--ranks`` ranks of one job allocating ``--size / --ranks`` each, all at once (threads,
   one channel each, as separate trainer processes would);
3. tmpfs's own: the kernel calls an allocation makes (posix_fallocate, MADV_POPULATE_WRITE,
   mlock) on /dev/shm files in this process, for one file of ``--size`` and ``--ranks`` at once:
   the baseline of 1 and 2, measured in the same pattern.

Each repetition alternates which comes first (on the VM, memory freed a while ago is slower to
touch again than memory freed just now: whatever runs first after a pause pays for it).
Output under --out: allocate.md and allocate.json (raw samples included).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient

from swap_state.server import _posix

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
    client = SwapStateClient(ClientConfig(address, rpc_timeout_s=600.0))
    try:
        session = client.attach(job, rank, world)
        session.allocate([("state.w.exp_avg", "float32", [nbytes // 4])])
        session.close(keep=False)
    finally:
        client.close()


def _ranks_at_once(address: str, job: str, ranks: int, nbytes: int) -> float:
    """Seconds for ``ranks`` ranks of a job to allocate ``nbytes / ranks`` each, all at once."""
    with concurrent.futures.ThreadPoolExecutor(ranks) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda r: _allocate(address, job, r, ranks, nbytes // ranks), range(ranks)))
        return time.perf_counter() - t0


def _tmpfs_files(shm_dir: str, count: int, nbytes: int) -> float:
    """Seconds for ``count`` threads to each commit, map, populate and mlock a /dev/shm file of
    ``nbytes`` (an allocation's kernel calls, without the server), then free them."""
    def one(index: int) -> None:
        path = os.path.join(shm_dir, f"raw-{index}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            with mmap.mmap(fd, nbytes) as mapping:
                address = _posix.buffer_address(mapping)
                chunks = range(0, nbytes, 256 << 20)
                with concurrent.futures.ThreadPoolExecutor(min(2, len(chunks))) as pool:
                    list(pool.map(lambda at: _posix.populate_write(address + at, min(256 << 20, nbytes - at)), chunks))
                _posix.mlock(address, nbytes)
        finally:
            os.close(fd)
            os.unlink(path)

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, range(count)))
        return time.perf_counter() - t0


def measure(args) -> dict[str, Any]:
    nbytes = util.parse_size(args.size)
    shm_dir = tempfile.mkdtemp(prefix="swap-state-bench-alloc-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="swap-state-bench-alloc-")
    server = EmbeddedServer(EmbeddedServerConfig(shm_size_bytes=nbytes + (512 << 20), snapshot_dir=work,
                                                 auto_restart=False, server={"shm_dir": shm_dir, "cow_budget": 0})).start()
    raw_dir = tempfile.mkdtemp(prefix="swap-state-bench-raw-", dir="/dev/shm")
    seconds: dict[str, list[float]] = {"one_rank": [], "ranks_at_once": [], "tmpfs_one": [], "tmpfs_at_once": []}
    runs = {
        "one_rank": lambda rep: _ranks_at_once(server.address, f"one-{rep}", 1, nbytes),
        "ranks_at_once": lambda rep: _ranks_at_once(server.address, f"many-{rep}", args.ranks, nbytes),
        "tmpfs_one": lambda rep: _tmpfs_files(raw_dir, 1, nbytes),
        "tmpfs_at_once": lambda rep: _tmpfs_files(raw_dir, args.ranks, nbytes // args.ranks),
    }
    try:
        for rep in range(args.reps):
            for key in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
                seconds[key].append(runs[key](rep))
    finally:
        server.stop()
        for path in (shm_dir, work, raw_dir):
            shutil.rmtree(path, ignore_errors=True)
    rates = {k: [nbytes / s / GiB for s in v] for k, v in seconds.items()}
    return {"bytes": nbytes, "ranks": args.ranks, "cpus": util.cpu_count(), "seconds": seconds,
            "gib_per_s": {k: summarize(v) for k, v in rates.items()}}


def markdown(result: dict[str, Any]) -> str:
    g = result["gib_per_s"]
    n = result["ranks"]
    rows = [("one rank", "one_rank"), (f"{n} ranks at once (together)", "ranks_at_once"),
            ("tmpfs's own: one file (fallocate, populate, mlock; no server)", "tmpfs_one"),
            (f"tmpfs's own: {n} files at once", "tmpfs_at_once")]
    lines = [f"# Segment creation ({fmt_bytes(result['bytes'])} in all, {result['cpus']} CPUs)", "",
             "| what | n | GiB/s median | mean | worst |", "| --- | --- | --- | --- | --- |"]
    for label, key in rows:
        v = g[key]
        lines.append(f"| {label} | {v['n']} | {v['median']:.2f} | {v['mean']:.2f} | {v['min']:.2f} |")
    together = g["ranks_at_once"]["median"] / g["one_rank"]["median"]
    raw = g["tmpfs_at_once"]["median"] / g["tmpfs_one"]["median"]
    lines += ["", f"{n} ranks at once ÷ one rank (medians): {together:.2f} (tmpfs's own, the same pattern: "
              f"{raw:.2f}); one rank ÷ tmpfs's one file: {g['one_rank']['median'] / g['tmpfs_one']['median']:.2f}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_small_bench(argv, _parser(), measure, markdown, "allocate")


if __name__ == "__main__":
    sys.exit(main())
