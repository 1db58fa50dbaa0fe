"""``python -m bench.replicas``: snapshots replicated into a peer server's memory (issue 50,
item 8), each number beside a baseline measured in the same run.

1. replication: a snapshot sent to the peer while the disk persists, and a memory-only one (this
   host's memory and the peer's), each from its start until the peer committed it (the server's ``snapshot_replicated`` line), vs a raw TCP copy of the same
   data file between two processes over loopback from /dev/shm (``bench.transport``'s baseline);
2. the optimizer step while a snapshot is persisted and replicated, vs the steps just before
   (no snapshot); ``--isolate`` pins both servers to the last CPU and the trainer to the others;
3. host loss: host a (one rank) replicates into host b and uploads to a directory store, then is
   lost (server stopped, directories deleted); its rank restarts on host b and restores from b's
   memory, and on a fresh host c from the directory store: from the restart to the first step.

Output under --out: replicas.md (tables), replicas.json (every sample).
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from swap_state.client.device import DeviceBackend
from swap_state.client.remote import container as remote_container
from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.common.retry import wait_until

from bench.cli import MOMENT_BYTES_PER_PARAM, _log, _pin_process
from bench.report import write_json
from bench.transport import raw_tcp_seconds
from bench.util import fmt_bytes, free_port, gbps, parse_size, summarize
from bench.workload import ADAMW_KWARGS, Variant, build_model

__all__ = ["main"]

WAIT_S = 600.0
QUIET_STEPS = 5  # steps without a snapshot measured before each one with
# Untimed snapshots of each kind first: a job's first replicas write fresh pages, the later ones
# write over those of the steps retention removed (spare files), as a job does for good.
WARM_UP = 2
SECRET = "bench-replica-secret-0123456789abcdef"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", default="16M", help="model parameters (fp32 Adam moments: 8 bytes each; K/M/G suffixes)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each timing")
    p.add_argument("--out", default="results", help="folder for replicas.md and replicas.json")
    p.add_argument("--isolate", action="store_true", help="replication: the sender and the peer each on a CPU of "
                   "its own (two hosts); the step: both servers on the last CPU, the trainer on the others (as a GPU "
                   "host's server has cores of its own)")
    p.add_argument("--work-dir", default=None, help="folder for the snapshot directories and the store "
                   "(removed at the end); None: --out")
    return p


class _Host:
    """A server standing for a host: its own shm and snapshot directories, replica settings."""

    def __init__(self, work: str, tag: str, state_bytes: int, **server: Any):
        self.shm_dir = tempfile.mkdtemp(prefix=f"swap-state-bench-{tag}-", dir="/dev/shm")
        self.snapshot_dir = tempfile.mkdtemp(prefix=f"{tag}-snapshots-", dir=work)
        shm = 2 * state_bytes + (64 << 20)  # a copy pool of the state: as the no-pause bench's --cow-budget state
        self.server = EmbeddedServer(EmbeddedServerConfig(
            shm_size_bytes=shm + state_bytes, snapshot_dir=self.snapshot_dir,
            server={"cow_budget": state_bytes, "shm_dir": self.shm_dir, **server})).start()
        self.address, self.ranks = self.server.address, []

    def restored_from(self) -> str:
        """``source=`` of the server's last ``restore_assembled`` line."""
        with open(os.path.join(self.server.workdir, "server.log"), errors="replace") as f:
            lines = [line for line in f if "event=restore_assembled " in line]
        return next((w.split("=", 1)[1] for w in lines[-1].split() if w.startswith("source=")), "?") if lines else "?"

    def replicated(self, snapshot_id: str) -> tuple[int, float]:
        """(bytes, seconds) of the server's ``snapshot_replicated`` line of ``snapshot_id``."""
        found = lambda: [line for line in open(os.path.join(self.server.workdir, "server.log"), errors="replace")
                         if "event=snapshot_replicated " in line and f"snapshot_id={snapshot_id} " in line]
        if not wait_until(lambda: bool(found()), timeout_s=10.0):
            raise RuntimeError(f"no snapshot_replicated line of {snapshot_id} in the server log")
        words = dict(w.split("=", 1) for w in found()[-1].split() if "=" in w)
        return int(words["bytes"]), float(words["seconds"])

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
        self.server.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)


def _remote(base, address: str, job: str) -> Variant:
    model = copy.deepcopy(base)
    x = torch.randn(8, model.layers[0].in_features, generator=torch.Generator().manual_seed(0))
    optimizer = remote_container.RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, dict(ADAMW_KWARGS), 16, server=address, job_id=job,
        config=remote_container.RemoteConfig(rpc_timeout_s=60.0), device_backend=DeviceBackend("cpu"))
    return Variant("remote", model, optimizer, x, lambda: None)


def replication_section(args, a: _Host, b: _Host, remote: Variant) -> dict[str, Any]:
    """Snapshots sent while the disk persists and memory-only ones, after ``WARM_UP`` of each:
    from the snapshot's start to the peer's commit
    (the server's ``snapshot_replicated`` line), against a raw TCP copy of the same data file
    from /dev/shm (where the sender reads it: the trainer's segment) in the same run. With
    --isolate each side on a CPU of its own, as two hosts: the sender (and the idle trainer) on
    the first, the peer on the last; the raw copy likewise."""
    cpus = sorted(os.sched_getaffinity(0))
    sides = (cpus[0], cpus[-1]) if args.isolate else (None, None)
    if args.isolate:
        _pin_process(a.server.pid, cpus[:1])
        _pin_process(b.server.pid, cpus[-1:])
    s: dict[str, list[float]] = defaultdict(list)
    for _ in range(WARM_UP):
        for memory_only in (False, True):
            remote.step()
            remote.optimizer.snapshot(memory_only=memory_only).wait_replicated(WAIT_S)
    for _ in range(args.reps):
        for kind, memory_only in (("", False), ("memory_only_", True)):
            remote.step()
            handle = remote.optimizer.snapshot(memory_only=memory_only)
            handle.wait_replicated(WAIT_S)
            folder = Path(handle.wait_durable(WAIT_S).path)
            nbytes, seconds = a.replicated(handle.snapshot_id)
            s[f"{kind}replica_gbps"].append(gbps(nbytes, seconds))
        data = folder / "rank-00000.safetensors"
        in_memory = Path(tempfile.mkdtemp(prefix="swap-state-bench-raw-src-", dir="/dev/shm")) / data.name
        shutil.copyfile(data, in_memory)
        try:
            raw_memory = min(raw_tcp_seconds(str(in_memory), 1, cpus=sides))
        finally:
            shutil.rmtree(in_memory.parent, ignore_errors=True)
        s["raw_tcp_memory_gbps"].append(gbps(data.stat().st_size, raw_memory))
        for kind in ("", "memory_only_"):
            s[f"{kind}ratio_to_raw_tcp_memory"].append(s[f"{kind}replica_gbps"][-1] / s["raw_tcp_memory_gbps"][-1])
        _log(f"  replica ({fmt_bytes(nbytes)}): {s['replica_gbps'][-1]:.3f} GB/s while the disk persists, "
             f"{s['memory_only_replica_gbps'][-1]:.3f} GB/s memory-only; raw TCP of the data file "
             f"{s['raw_tcp_memory_gbps'][-1]:.3f} GB/s from /dev/shm")
    return {"bytes": nbytes, **{k: {**summarize(v), "samples": v} for k, v in s.items()}}


def step_section(args, remote: Variant) -> dict[str, Any]:
    """The optimizer step while a snapshot persists and is sent to the peer, against the steps
    just before it (no snapshot), alternating ``--reps`` times."""
    s: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.reps):
        quiet = [remote.step()[1] for _ in range(QUIET_STEPS)]
        handle = remote.optimizer.snapshot()
        during = [remote.step()[1]]
        while handle.status().state == "persisting":  # settled with the replica (the commit waits for it)
            during.append(remote.step()[1])
        handle.wait_replicated(WAIT_S)
        s["quiet_step_s"].extend(quiet)
        s["replicating_step_s"].extend(during)
        s["mean_ratio"].append(statistics.mean(during) / statistics.mean(quiet))
        s["worst_ratio"].append(max(during) / statistics.median(quiet))
        _log(f"  {len(during)} steps while replicating: mean {s['mean_ratio'][-1]:.3f}x, worst "
             f"{s['worst_ratio'][-1]:.3f}x of the quiet steps' mean / median")
    return {k: {**summarize(v), "samples": v} for k, v in s.items()}


def _restart(address: str, base, job: str) -> tuple[float, float, float, Variant]:
    """A restarted rank: (attach and allocate, restore, first step) seconds, and the rank."""
    t0 = time.perf_counter()
    rank = _remote(base, address, job)
    t1 = time.perf_counter()
    rank.optimizer.restore("latest")
    t2 = time.perf_counter()
    rank.step()
    return t1 - t0, t2 - t1, time.perf_counter() - t2, rank


def host_loss_section(args, work: str, base, state: int) -> dict[str, Any]:
    secret = Path(work) / "replica-secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    store, port = str(Path(work) / "store"), free_port()
    s: dict[str, list[float]] = defaultdict(list)
    for rep in range(args.reps):
        job = f"bench-replica-loss-{os.getpid()}-{rep}"
        b = _Host(work, "host-b", state, replica_listen=f"tcp://127.0.0.1:{port}", replica_size=str(4 * state),
                  replica_secret_file=str(secret))
        a = _Host(work, "host-a", state, replica_peers=f"tcp://127.0.0.1:{port}", replica_secret_file=str(secret),
                  snapshot_store=store)
        try:
            a.ranks.append(rank := _remote(base, a.address, job))
            rank.step()
            handle = rank.optimizer.snapshot()
            handle.wait_replicated(WAIT_S)
            handle.wait_stored(WAIT_S)
            a.close()  # host a is lost
            sources = [("replica", b), ("store", None)]
            for where, host in sources if rep % 2 == 0 else sources[::-1]:  # neither always restarts first
                fresh = host or _Host(work, "host-c", state, snapshot_store=store)
                try:
                    attach, restore, first, restarted = _restart(fresh.address, base, job)
                    fresh.ranks.append(restarted)
                    source = fresh.restored_from()
                    s[f"{where}_restore_s"].append(restore)
                    s[f"{where}_restart_to_first_step_s"].append(attach + restore + first)
                    s[f"{where}_restore_gbps"].append(gbps(state, restore))
                    _log(f"  host loss {rep}, from the {where} (source={source}): attach {attach:.2f} s, "
                         f"restore {restore:.2f} s, first step {first:.2f} s")
                finally:
                    if host is None:
                        fresh.close()
        finally:
            b.close()
    return {"bytes": state, **{k: {**summarize(v), "samples": v} for k, v in s.items()}}


def _cell(stats: dict[str, Any], worst: str = "min", digits: int = 3) -> str:
    return f"{stats['median']:.{digits}f} / {stats['mean']:.{digits}f} / {stats[worst]:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    rep, step, loss = result["replication"], result["step"], result["host_loss"]
    lines = ["# Replicas in a peer's memory", "", f"`{result['command']}`, {fmt_bytes(result['state_bytes'])} of moments, "
             f"{result['seconds']:.0f} s. Cells: median / mean / worst.", "",
             "| replication | GB/s or ratio |", "| --- | --- |",
             f"| snapshot start -> replicated, while the disk persists | {_cell(rep['replica_gbps'])} |",
             f"| snapshot start -> replicated, memory-only | {_cell(rep['memory_only_replica_gbps'])} |",
             f"| raw TCP of the data file from /dev/shm | {_cell(rep['raw_tcp_memory_gbps'])} |",
             f"| replication while the disk persists ÷ raw TCP | {_cell(rep['ratio_to_raw_tcp_memory'])} |",
             f"| memory-only replication ÷ raw TCP | {_cell(rep['memory_only_ratio_to_raw_tcp_memory'])} |", "",
             f"| optimizer step while replicating{' (isolated)' if result['isolated'] else ''} | ratio |",
             "| --- | --- |",
             f"| mean step ÷ quiet mean | {_cell(step['mean_ratio'], 'max')} |",
             f"| worst step ÷ quiet median | {_cell(step['worst_ratio'], 'max')} |", "",
             "| host loss, one rank | from the peer's memory | from the directory store |", "| --- | --- | --- |"]
    for key, label in (("restore_gbps", "restore GB/s"), ("restore_s", "restore s"),
                       ("restart_to_first_step_s", "restart (attach, restore, first step) s")):
        worst = "min" if key.endswith("gbps") else "max"
        lines.append(f"| {label} | {_cell(loss['replica_' + key], worst)} | {_cell(loss['store_' + key], worst)} |")
    return "\n".join(lines) + "\n"


def _isolate_servers(*hosts: _Host) -> None:
    """Both servers on the last CPU, this trainer (and torch's threads) on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--isolate needs at least 2 usable CPUs")
    for host in hosts:
        _pin_process(host.server.pid, cpus[-1:])
    _pin_process("self", cpus[:-1])
    torch.set_num_threads(len(cpus) - 1)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="swap-state-bench-replicas-", dir=args.work_dir or args.out)
    started = time.monotonic()
    try:
        params = parse_size(args.params)
        base = build_model(params, torch.device("cpu"))
        state = sum(p.numel() for p in base.parameters()) * MOMENT_BYTES_PER_PARAM
        secret = Path(work) / "replica-secret"
        secret.write_text(SECRET)
        secret.chmod(0o600)
        port = free_port()
        b = _Host(work, "peer", state, replica_listen=f"tcp://127.0.0.1:{port}", replica_size=str(4 * state),
                  replica_secret_file=str(secret))
        a = _Host(work, "sender", state, replica_peers=f"tcp://127.0.0.1:{port}", replica_secret_file=str(secret))
        try:
            a.ranks.append(remote := _remote(base, a.address, f"bench-replicas-{os.getpid()}"))
            _log(f"replication: {fmt_bytes(state)} of moments")
            replication = replication_section(args, a, b, remote)
            _log("the optimizer step while replicating")
            if args.isolate:
                _isolate_servers(a, b)
            step = step_section(args, remote)
        finally:
            a.close()
            b.close()
        _log("host loss: restore from the peer's memory and from the directory store")
        loss = host_loss_section(args, work, base, state)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"command": "python -m bench.replicas " + " ".join(argv if argv is not None else sys.argv[1:]),
              "state_bytes": state, "replication": replication, "step": step, "host_loss": loss,
              "isolated": args.isolate,
              "seconds": time.monotonic() - started}
    write_json(result, os.path.join(args.out, "replicas.json"))
    Path(args.out, "replicas.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
