"""``python -m bench.store``: the snapshot store (``--snapshot-store``) in one run, each number
beside the store's own speed for the same bytes; for a local directory (a shared filesystem's
stand-in) and S3 (a moto server process on this machine: its numbers are moto's, not S3's).

1. upload: the server's throughput (its ``snapshot_stored`` line) vs ``store.put`` of the same files;
2. restore: a fresh server, a new container of the rank: ``restore("latest")`` vs ``get_range``;
3. step time while an upload runs vs with none, sharing the CPUs and (``--isolate``) isolated;
4. host loss: ranks 0, 1 of a stopped host (dirs deleted) attach to a new server and restore.

Output under --out: store.md (tables), store.json (everything, raw samples included).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Self

import torch
from swap_state.client.device import DeviceBackend
from swap_state.client.remote import container as remote_container
from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.common.object_store import open_store
from swap_state.common.retry import wait_until
from swap_state.common.snapshot_format import rank_data_name, rank_manifest_name
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.snapshot.tiers.seam import COPY_BLOCK_BYTES

from bench import hardware, util
from bench.cli import MOMENT_BYTES_PER_PARAM, _contention, _isolate, _log, _pin_process
from bench.goals import _x
from bench.report import write_json
from bench.util import fmt_bytes, fmt_count, fmt_ms, gbps, summarize
from bench.workload import ADAMW_KWARGS, Variant, build_model, model_shape

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the test kits: moto's S3 endpoint
import store_kit

__all__ = ["main"]

WAIT_S = 600.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", default="16M", help="model parameters (fp32 Adam moments: 8 bytes each; K/M/G "
                   "binary suffixes); the host-loss section splits them over its two ranks")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per phase of the step-time section")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each upload, restore and host-loss timing")
    p.add_argument("--store", choices=("path", "s3", "both"), default="both",
                   help="a local directory (a shared filesystem's stand-in), S3 via a moto server process, or both")
    p.add_argument("--isolate", action="store_true", help="also time the step-time section with the server pinned "
                   "to the last CPU, the trainer (torch threads to match) on the rest; needs >= 2 usable CPUs")
    p.add_argument("--out", default="results", help="folder for store.md and store.json")
    p.add_argument("--work-dir", default=None, help="folder in which a scratch directory (snapshot dirs, the path "
                   "store, moto's log) is created and removed at the end; None: --out")
    return p


class Host:
    """A server standing for one host: its own shm and snapshot directories, one store; its
    containers (``ranks``). On exit: the containers closed, the server stopped, its dirs deleted."""

    def __init__(self, work: str, tag: str, uri: str, state_bytes: int):
        self.shm_dir = tempfile.mkdtemp(prefix=f"swap-state-bench-{tag}-", dir="/dev/shm")
        self.snapshot_dir = tempfile.mkdtemp(prefix=f"{tag}-snapshots-", dir=work)
        shm = 2 * state_bytes + (64 << 20)
        cow = max(4 << 20, shm // 8)
        self.server = EmbeddedServer(EmbeddedServerConfig(
            shm_size_bytes=shm + cow, snapshot_dir=self.snapshot_dir,
            server={"cow_budget": cow, "shm_dir": self.shm_dir, "snapshot_store": uri})).start()
        self.address, self.ranks = self.server.address, []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for r in self.ranks:
            r.close()
        self.server.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)

    def events(self, name: str) -> list[dict[str, str]]:
        """The server's ``event=name`` log lines as dicts (the whole log, not log_text's tail)."""
        with open(os.path.join(self.server.workdir, "server.log"), errors="replace") as f:
            lines = [line for line in f if f"event={name} " in line]
        return [{k: v.strip('"') for k, v in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)} for line in lines]

    def event(self, name: str, snapshot_id: str) -> dict[str, str]:
        """The last ``event=name`` line of ``snapshot_id`` (logged just after the reply: waited for)."""
        found = lambda: [e for e in self.events(name) if e.get("snapshot_id") == snapshot_id]
        if not wait_until(lambda: bool(found()), timeout_s=10.0):
            raise RuntimeError(f"no event={name} of {snapshot_id} in the server log")
        return found()[-1]


def _remote(base, address: str, job: str, rank: int = 0, world: int = 1) -> Variant:
    """A remote container (rank of world, all on one server) over a copy of ``base``, as a Variant."""
    model = copy.deepcopy(base)
    x = torch.randn(8, model.layers[0].in_features, generator=torch.Generator().manual_seed(rank))
    config = remote_container.RemoteConfig(rank=rank, world_size=world, local_world_size=world, rpc_timeout_s=60.0)
    optimizer = remote_container.RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, dict(ADAMW_KWARGS), 16, server=address, job_id=job, config=config,
        device_backend=DeviceBackend("cpu"))
    return Variant("remote", model, optimizer, x, lambda: None)


def _store_uri(kind: str, work: str, stack: contextlib.ExitStack) -> str:
    if kind == "path":
        return os.path.join(work, "store")
    endpoint = stack.enter_context(store_kit.moto_endpoint(os.path.join(work, "moto.log")))
    os.environ.update(store_kit.aws_env(endpoint))  # the servers started afterwards inherit them
    bucket = f"swap-state-bench-{os.getpid()}"
    store_kit.create_bucket(endpoint, bucket)
    _log(f"moto S3 endpoint {endpoint}, bucket {bucket}")
    return f"s3://{bucket}/snapshots"


def _pair(s: dict[str, list[float]], name: str, gb_s: float, base_bytes: int, base_s: float) -> None:
    """One repetition: swap-state's GB/s, the store's own (bytes, seconds), and their ratio."""
    s[f"{name}_gbps"].append(gb_s)
    s["baseline_s"].append(base_s)
    s["baseline_gbps"].append(gbps(base_bytes, base_s))
    s["ratio"].append(gb_s / s["baseline_gbps"][-1])


def _summ(samples: dict[str, list[float]]) -> dict[str, Any]:
    return {k: {**summarize(v), "samples": v} for k, v in samples.items()}


def _put_files(store, files: list[Path], prefix: str) -> tuple[int, float]:
    """``store.put`` of each local file, read in the uploader's blocks; (bytes, seconds)."""
    def blocks(path: Path):
        with open(path, "rb", buffering=0) as f:
            while block := f.read(COPY_BLOCK_BYTES):
                yield block

    t0 = time.perf_counter()
    for path in files:
        store.put(f"{prefix}/{path.name}", blocks(path))
    seconds = time.perf_counter() - t0
    for path in files:
        store.delete(f"{prefix}/{path.name}")
    return sum(p.stat().st_size for p in files), seconds


def upload_section(args, store, host: Host, remote: Variant) -> dict[str, Any]:
    """Per repetition: a step, a snapshot, durable, its upload timed; then ``store.put`` of its files."""
    s: dict[str, list[float]] = defaultdict(list)
    for rep in range(args.reps):
        remote.step()
        handle = remote.optimizer.snapshot()
        folder = Path(handle.wait_durable(WAIT_S).path)
        t0 = time.perf_counter()
        handle.wait_stored(WAIT_S)
        s["durable_to_stored_s"].append(time.perf_counter() - t0)
        event = host.event("snapshot_stored", handle.snapshot_id)
        s["server_s"].append(float(event["seconds"]))
        put_bytes, put_s = _put_files(store, [folder / rank_data_name(0), folder / rank_manifest_name(0)],
                                      f"bench-baseline/{os.getpid()}-{rep}")
        _pair(s, "server", int(event["bytes_per_s"]) / 1e9, put_bytes, put_s)
        _log(f"  upload {handle.snapshot_id} ({fmt_bytes(int(event['bytes']))}): server "
             f"{s['server_gbps'][-1]:.3f} GB/s, store put {s['baseline_gbps'][-1]:.3f} GB/s ({fmt_bytes(put_bytes)})")
    return {"bytes": int(event["bytes"]), **_summ(s)}


def _get_tensors(store, job: str, path_store: bool) -> tuple[int, float]:
    """``store.get_range`` of every tensor the restore reads (the latest step, rank 0)."""
    stored = StoredSnapshots(store)
    manifest = stored.read_manifest(info := stored.resolve("latest", job), 0)
    key = stored.key(job, info.step, manifest.data_file)
    if path_store:
        hardware.drop_tree_cache(store.root)
    t0 = time.perf_counter()
    got = sum(len(store.get_range(key, manifest.data_start + t.data_offsets[0], t.nbytes))
              for t in manifest.tensors)
    return got, time.perf_counter() - t0


def restore_section(args, store, host: Host, remote: Variant, job: str, path_store: bool) -> dict[str, Any]:
    """Per repetition: ``restore("latest")`` (from the store: the server's log says), then ``get_range``."""
    remote.step()  # the state allocated and used, as a trainer that restores mid-run
    s: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.reps):
        if path_store:
            hardware.drop_tree_cache(store.root)
        t0 = time.perf_counter()
        step = remote.optimizer.restore("latest")
        s["restore_s"].append(time.perf_counter() - t0)
        event = host.event("restore_assembled", f"{job}/step-{step}")
        if event.get("source") != "store":
            raise RuntimeError(f"restore read from {event.get('source')}, not the store: {event}")
        got, get_s = _get_tensors(store, job, path_store)
        _pair(s, "restore", gbps(int(event["bytes"]), s["restore_s"][-1]), got, get_s)
        _log(f"  restore step {step} ({fmt_bytes(int(event['bytes']))}): {s['restore_gbps'][-1]:.3f} GB/s, "
             f"store get_range {s['baseline_gbps'][-1]:.3f} GB/s ({fmt_bytes(got)})")
    return {"bytes": int(event["bytes"]), "page_cache_dropped": path_store, **_summ(s)}


def _uploading(handle) -> bool:
    reply = handle.status(0.0, wait_stored=True)
    if reply.state == "failed" or reply.store_state == "failed":
        raise RuntimeError(f"snapshot {handle.snapshot_id}: {reply.error or reply.store_error}")
    return reply.state != "stored"


def overlap_section(args, remote) -> dict[str, Any]:
    """Rounds: a snapshot, durable (no steps), then steps until it is stored (``uploading``),
    then as many steps with no upload running (``idle``), back to back."""
    steps: dict[str, list[tuple[float, float]]] = {"idle": [], "uploading": []}  # (train, opt) seconds
    snapshots, deadline = 0, time.monotonic() + max(60.0, 4.0 * args.steps)
    remote.step()  # warm-up, untimed
    while len(steps["uploading"]) < args.steps and time.monotonic() < deadline and snapshots < 2 * args.steps + 5:
        remote.step()  # a new step to snapshot
        handle = remote.optimizer.snapshot()
        handle.wait_durable(WAIT_S)
        snapshots += 1
        n = 0
        while len(steps["uploading"]) < args.steps and _uploading(handle):
            steps["uploading"].append(remote.step())
            n += 1
        handle.wait_stored(WAIT_S)
        steps["idle"].extend(remote.step() for _ in range(max(1, n)))
    return {"snapshots": snapshots, **_summ({f"{phase}_{kind}_s": [t[i] for t in got] for phase, got in steps.items()
                                             for i, kind in enumerate(("train", "opt"))})}


@contextlib.contextmanager
def _isolated(server_pid: int):
    """The server on the last CPU, this process (the trainer) and torch's threads on the rest."""
    cpus, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if len(cpus) < 2:
        raise SystemExit(f"--isolate needs >= 2 usable CPUs; this process may use {cpus}")
    info = {"server_cpus": cpus[-1:], "trainer_cpus": cpus[:-1]}
    info.update(_isolate(server_pid, info["server_cpus"], info["trainer_cpus"]))
    try:
        yield info
    finally:
        _pin_process(server_pid, cpus)
        _pin_process("self", cpus)
        torch.set_num_threads(threads)


def host_loss_section(args, uri: str, work: str, base, job: str, state: int) -> dict[str, Any]:
    """Host A (ranks 0, 1 of world 2) stores a snapshot and is lost; per repetition a new host recovers."""
    with Host(work, "host-a", uri, state) as host:
        host.ranks.extend(_remote(base, host.address, job, rank, 2) for rank in (0, 1))
        for r in host.ranks * 2:
            r.step()
        handles = [r.optimizer.snapshot() for r in host.ranks]
        for h in handles:
            h.wait_stored(WAIT_S)
    step = handles[0].step
    s: dict[str, list[float]] = defaultdict(list)
    for rep in range(args.reps):
        t0 = time.perf_counter()
        with Host(work, f"host-b{rep}", uri, state) as host:
            t1 = time.perf_counter()
            host.ranks.extend(_remote(base, host.address, job, rank, 2) for rank in (0, 1))
            t2 = time.perf_counter()
            restored = [r.optimizer.restore("latest") for r in host.ranks]
            t3 = time.perf_counter()
            sources = [e.get("source") for e in host.events("restore_assembled")]
        if restored != [step, step] or sources != ["store", "store"]:
            raise RuntimeError(f"host-loss restore got steps {restored} from {sources}, expected {step} from the store")
        for key, value in zip(("server_start_s", "attach_allocate_s", "restore_s", "total_s"),
                              (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            s[key].append(value)
        _log(f"  host loss {rep}: server start {t1 - t0:.2f} s, attach+allocate {t2 - t1:.2f} s, "
             f"restore {t3 - t2:.2f} s")
    return {"step": step, "bytes": state, **_summ(s)}


def run_store(args, kind: str, work: str, params: int) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        uri = _store_uri(kind, work, stack)
        store = open_store(uri)
        base = build_model(params, torch.device("cpu"))
        state = sum(p.numel() for p in base.parameters()) * MOMENT_BYTES_PER_PARAM
        job = f"bench-store-{kind}-{os.getpid()}"
        out: dict[str, Any] = {"uri": uri, "state_bytes": state, "model": model_shape(params)}
        _log(f"{kind} store {uri}: {fmt_bytes(state)} of moments; upload")
        with Host(work, "upload", uri, state) as host:
            host.ranks.append(_remote(base, host.address, job))
            out["upload"] = upload_section(args, store, host, host.ranks[0])
        _log(f"{kind}: restore from the store on a fresh host")
        with Host(work, "restore", uri, state) as host:
            host.ranks.append(remote := _remote(base, host.address, job))
            out["restore"] = restore_section(args, store, host, remote, job, kind == "path")
            _log(f"{kind}: step time while uploading (trainer and server share the CPUs)")
            out["steps"] = {"shared": overlap_section(args, remote)}
            if args.isolate:
                with _isolated(host.server.pid) as info:
                    _log(f"{kind}: step time while uploading, isolated")
                    out["steps"]["isolated"] = {**overlap_section(args, remote), "isolation": info}
        half = build_model(params // 2, torch.device("cpu"))
        _log(f"{kind}: host loss (ranks 0, 1 of world 2, {fmt_count(params // 2)} params each)")
        half_state = sum(p.numel() for p in half.parameters()) * MOMENT_BYTES_PER_PARAM * 2
        out["host_loss"] = host_loss_section(args, uri, work, half, f"{job}-host", half_state)
    return out


def _c(stats: dict[str, Any], digits: int, worst: str = "max") -> str:
    return " / ".join(_x(stats[k], digits) for k in ("median", "mean", worst)) if stats.get("n") else "n/a"


def _table(add, title: str, note: str, headers: tuple[str, ...], rows: list[list[str]]) -> None:
    add(f"## {title}\n\n{note}\n\n| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
    add("\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n")


def _step_rows(stores: dict[str, Any]) -> list[list[str]]:
    rows = []
    cell = lambda st: " / ".join(fmt_ms(st.get(k)) for k in ("median", "mean", "p99", "max"))
    for kind, r in stores.items():
        for m in r["steps"].values():
            iso = m.get("isolation")
            cpus = f"server {iso['server_cpus']}, trainer {iso['trainer_cpus']}" if iso else "shared"
            for phase in ("idle", "uploading"):
                o, i = m[f"{phase}_opt_s"], m["idle_opt_s"]
                ratio = " / ".join(f"{o[k] / i[k]:.2f}" for k in ("median", "mean", "max")) \
                    if phase == "uploading" and o.get("n") and i.get("n") else ""
                rows.append([kind, cpus, phase, f"{o['n']} ({m['snapshots']} snapshots)", cell(o),
                             cell(m[f"{phase}_train_s"]), ratio])
    return rows


def _sections_md(stores: dict[str, Any], add) -> None:
    up, rs, hl = ([(k, r[x]) for k, r in stores.items()] for x in ("upload", "restore", "host_loss"))
    _table(add, "1. Upload throughput against the store's own write throughput",
           "Median / mean / worst of the repetitions (worst: lowest throughput, highest time). swap-state: its "
           "server's `snapshot_stored` line (bytes ÷ upload seconds); store put: `open_store(uri).put` of the same "
           "local files in the same 8 MiB blocks, right after; ratio: the two, paired per repetition.",
           ("store", "bytes", "swap-state upload GB/s", "store put GB/s", "ratio", "durable → stored, trainer (s)"),
           [[k, fmt_bytes(u["bytes"]), _c(u["server_gbps"], 3, "min"), _c(u["baseline_gbps"], 3, "min"),
             _c(u["ratio"], 2, "min"), _c(u["durable_to_stored_s"], 2)] for k, u in up])
    _table(add, "2. Restore-from-store throughput",
           "A fresh server (fresh dirs, same store), a new container of the same rank: `restore(\"latest\")` timed "
           "in the trainer; store get_range: the same tensors of the same object, right after. Median / mean / "
           "worst. The path store's page cache is dropped before each read.",
           ("store", "bytes", "restore GB/s", "restore s", "store get_range GB/s", "ratio"),
           [[k, fmt_bytes(x["bytes"]), _c(x["restore_gbps"], 3, "min"), _c(x["restore_s"], 2),
             _c(x["baseline_gbps"], 3, "min"), _c(x["ratio"], 2, "min")] for k, x in rs])
    _table(add, "3. Step time while uploading",
           "Rounds of: snapshot, durable (no steps), steps until stored (uploading), as many steps with no upload "
           "(idle). Median / mean / p99 / max. Isolated: the swap-state server pinned; moto is not.",
           ("store", "CPUs", "phase", "steps", "optimizer step", "train step", "opt uploading ÷ idle: median / mean / max"),
           _step_rows(stores))
    _table(add, "4. Host-loss recovery time",
           "Host A (ranks 0, 1 of world 2, one server, both ranks in this process) stores a snapshot, is stopped "
           "and its dirs deleted. Timed: server B (fresh dirs, same store) started until serving; both ranks attach "
           "and allocate; both restore `latest` from the store, one after the other. Seconds: median / mean / worst.",
           ("store", "bytes (2 ranks)", "server start", "attach + allocate", "restore", "total", "restore GB/s (median)"),
           [[k, fmt_bytes(h["bytes"]), _c(h["server_start_s"], 2), _c(h["attach_allocate_s"], 2), _c(h["restore_s"], 2),
             _c(h["total_s"], 2), _x(gbps(h["bytes"], h["restore_s"]["median"]))] for k, h in hl])


def markdown(results: dict[str, Any]) -> str:
    m, cfg, stores = results["machine"], results["config"], results["stores"]
    lines = ["# swap-state snapshot store benchmark\n"]
    add = lines.append
    add(f"- **Machine**: {m['cpu_model']}, {m['cpus_usable']} CPUs usable, {fmt_bytes(m['ram_bytes'])} RAM; disk "
        f"{m['disk'].get('fstype')} on {m['disk'].get('device')}; Linux {m['kernel']}, Python {m['python']}, torch "
        f"{m['torch']}, swap-state {m['swap_state']}")
    if c := m.get("contention"):
        add(f"- **Other load**: other processes {c['other_cpu_s_per_s']:.2f} CPU-s/s, this run with its servers and "
            f"moto {c['own_cpu_s_per_s']:.2f}; steal {c['steal_s_per_s']:.2f}")
    add(f"- **Run**: `{cfg['command']}` — {results['runtime_s']:.0f} s; {fmt_count(cfg['params'])} params, "
        f"{cfg['reps']} repetitions, {cfg['steps']} timed steps per phase")
    add("- **Stores**: " + "; ".join(f"{k}: `{r['uri']}`" for k, r in stores.items()))
    if "s3" in stores:
        add("- **S3 is moto**: a Python server process on this same machine, sharing its CPUs with the trainer and "
            "the swap-state server; its numbers are moto's, not S3's.")
    add("")
    _sections_md(stores, add)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    params = util.parse_size(args.params)
    out_dir = os.path.abspath(args.out)
    base_dir = os.path.abspath(args.work_dir or out_dir)
    for folder in (out_dir, base_dir):
        os.makedirs(folder, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".bench-store-work-", dir=base_dir)  # only this is ever removed
    command = "python -m bench.store " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    results: dict[str, Any] = {"machine": hardware.machine(work), "stores": {}}
    cpu_start, own_start, load_start = util.cpu_jiffies(), util.own_cpu_seconds(), util.loadavg()
    try:
        for kind in ("path", "s3") if args.store == "both" else (args.store,):
            results["stores"][kind] = run_store(args, kind, work, params)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["runtime_s"] = time.perf_counter() - started
    results["machine"]["contention"] = _contention(cpu_start, own_start, load_start, results["runtime_s"])
    results["config"] = {"command": command.strip(), "params": params, "steps": args.steps, "reps": args.reps,
                         "store": args.store, "isolate": args.isolate}
    Path(out_dir, "store.md").write_text(md := markdown(results) + "\n")
    write_json(results, os.path.join(out_dir, "store.json"))
    print(f"{md}\nwrote store.md, store.json in {out_dir}; runtime {results['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
