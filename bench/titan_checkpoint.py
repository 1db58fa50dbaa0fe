"""``python -m bench.titan_checkpoint``: how long torchtitan's ``CheckpointManager.save`` blocks
the training loop, in swap-state's whole-state snapshot mode against plain torchtitan.

torchtitan 0.2.2's own Trainer runs on the CPU (``tests/torchtitan/launcher.py``, observed by
:mod:`bench.titan_trainer`) on the llama3 job of ``tests/torchtitan/titan_testkit.py`` (seq 64,
batch 2, fp32, the offline tokenizer and dataset), per model size and mode:

* ``sync``      plain fused AdamW, ``--checkpoint.async_mode=disabled``;
* ``async``     plain fused AdamW, ``--checkpoint.async_mode=async`` (DCP ``async_save``);
* ``snapshot``  swap-state, ``--optimizer.swap_optimizer --optimizer.swap_optimizer_backend=remote
  --optimizer.swap_state_checkpoint=snapshot``: the checkpoint holds a reference, the server
  snapshots parameters and moments itself (the embedded server, or one started here);
* ``swap_nockpt`` swap-state remote in 'full' mode without checkpoints: the step time of the
  same optimizer without the per-step parameter copy of whole-state snapshots and without
  snapshots (a baseline for the step-time columns, no save to time).

Every checkpointing run saves every ``--interval`` steps (``--checkpoint.no-last_save_model_only``,
``keep_latest_k = 0``), ``--saves`` times, and stops a few steps after the last one without
torchtitan's last-step save (the launcher's stop-after-step), so that every timed save is an
interval save. Timed per save: the wall time of the trainer's ``checkpointer.save`` call, as
the training loop sees it (outside every wrapper), and when what it left running in the
background (DCP's write thread, the server's snapshot) is done. Per step: ``train_step``'s wall
time, classed as the step right after a save, a step that overlaps such background work, or a
quiet one (steps 1-2 are warm-up and left out).

Also measured: the whole state (parameters + AdamW moments, fp32), the checkpoint folder
(bytes per step folder and the tensor bytes its DCP metadata lists), the server's snapshot
folder in snapshot mode and, per snapshot, what it cost the steps while it persisted (the
server's back-pressure waits and seconds, the trainer's copy-before-write copies, the chunks it
staged itself) and the copy-slot budget it reports, trainer peak RSS, the machine's load from
other work during each run, and a short disk probe (what a synchronous save is bound by).

The trainer runs ``--threads`` torch threads (default 1: on a 2-CPU machine that leaves a CPU
to the server, DCP's writer thread and other work, the same for every mode).

``--pinned SIZE`` adds the three checkpointing modes at one size with the trainer on CPU 0
(``taskset -c 0``, one torch thread) and, in snapshot mode, a swap-state-server started here on
CPU 1 (``--optimizer.swap_state_server``).

Output under ``--out``: ``titan-checkpoint.md`` and ``titan-checkpoint.json`` (raw samples
included). Goals of the issue are reported (reached or not), never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.titan_report import CHECKPOINT_MODES, _med, evaluate_goals, markdown, summarize_size
from bench.util import cpu_jiffies, fmt_bytes, fmt_ms, loadavg, summarize

__all__ = ["MODES", "SIZES", "main", "run"]

REPO = Path(__file__).resolve().parents[1]
TITAN_TESTS = REPO / "tests" / "torchtitan"
TRAINER = Path(__file__).resolve().with_name("titan_trainer.py")
RECORD_ENV = "SWAP_STATE_BENCH_RECORD"
FLAVORS_ENV = "SWAP_STATE_BENCH_FLAVORS"
WARMUP_STEPS = 2
CHECKPOINT_FOLDER = "checkpoint"
SNAPSHOT_SUBDIR = "swap-state-snapshots"  # the glue's embedded-server snapshot folder

_LLAMA = {"vocab_size": 2048, "rope_theta": 500000}  # the testkit tokenizer's vocabulary
#: name -> llama3 flavor (built in, or registered by bench/titan_trainer.py from ``args``) and
#: the default checkpoint interval (steps): long enough, on a ~0.35 GB/s disk, for the
#: previous save's background write to end before the next save.
SIZES: dict[str, dict[str, Any]] = {
    "debugmodel": {"flavor": "debugmodel", "args": None, "interval": 4},
    "158M": {"flavor": "bench_158m", "args": {"dim": 1024, "n_layers": 12, "n_heads": 16, **_LLAMA}, "interval": 10},
    "346M": {"flavor": "bench_346m", "args": {"dim": 1536, "n_layers": 12, "n_heads": 16, **_LLAMA}, "interval": 10},
    "471M": {"flavor": "bench_471m", "args": {"dim": 2048, "n_layers": 9, "n_heads": 16, **_LLAMA}, "interval": 10},
}
DEFAULT_SIZES = "debugmodel,158M,471M"

_SWAP = [
    "--job.custom_config_module=swap_state.client.torchtitan_config",
    "--optimizer.swap_optimizer",
    "--optimizer.swap_optimizer_backend=remote",
]
#: name -> (description, torchtitan flags after the checkpoint flags, saves?)
MODES: dict[str, tuple[str, list[str], bool]] = {
    "sync": ("plain AdamW (fused), async_mode = disabled", ["--checkpoint.async_mode=disabled"], True),
    "async": ("plain AdamW (fused), async_mode = async", ["--checkpoint.async_mode=async"], True),
    "snapshot": ("swap-state remote, swap_state_checkpoint = snapshot",
                 [*_SWAP, "--optimizer.swap_state_checkpoint=snapshot"], True),
    "swap_nockpt": ("swap-state remote, 'full', checkpoints off (step-time baseline)",
                    [*_SWAP, "--optimizer.swap_state_checkpoint=full", "--checkpoint.no-enable"], False),
}  # fmt: skip
DEFAULT_MODES = "sync,async,snapshot,swap_nockpt"


def _log(message: str) -> None:
    print(f"[titan-checkpoint {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _testkit():
    if str(TITAN_TESTS) not in sys.path:
        sys.path.insert(0, str(TITAN_TESTS))
    import titan_testkit  # tests/torchtitan/titan_testkit.py: assets and the base job

    return titan_testkit


# --------------------------------------------------------------------------- measuring
def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _dcp_tensor_bytes(step_dir: Path) -> int | None:
    """Bytes of the tensors a DCP checkpoint folder's metadata lists (None: unreadable)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - reported as unknown
        return None
    return sum(
        math.prod(v.size) * v.properties.dtype.itemsize
        for v in md.values() if isinstance(v, TensorStorageMetadata)
    )  # fmt: skip


def _folders(dump: Path) -> dict[str, Any]:
    ckpt = dump / CHECKPOINT_FOLDER
    steps = sorted(ckpt.glob("step-*")) if ckpt.exists() else []
    per_step = [{"name": p.name, "bytes": _dir_bytes(p), "tensor_bytes": _dcp_tensor_bytes(p)} for p in steps]
    out: dict[str, Any] = {
        "checkpoint_bytes": _dir_bytes(ckpt),
        "checkpoint_steps": per_step,
        "checkpoint_step_bytes": summarize([s["bytes"] for s in per_step]),
    }
    snaps = dump / SNAPSHOT_SUBDIR
    if snaps.exists():
        snap_steps = sorted(p for p in snaps.glob("*/step-*") if p.is_dir())
        out["snapshot_dir_bytes"] = _dir_bytes(snaps)
        out["snapshot_step_bytes"] = summarize([_dir_bytes(p) for p in snap_steps])
    return out


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_SNAPSHOT_COUNTS = ("cow_copies", "trainer_copied_bytes", "backpressure_waits", "backpressure_wait_seconds",
                    "server_staged_bytes")


def analyze(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Saves (blocking, time to done in the background), steps classed by what ran with them."""
    state = next((e for e in events if e["kind"] == "state"), {})
    steps = [e for e in events if e["kind"] == "step"]
    saves = [e for e in events if e["kind"] == "save" and e["saves"]]
    durable = {e["step"]: e for e in events if e["kind"] == "durable"}
    save_rows = []
    for i, s in enumerate(saves):
        d = durable.get(s["step"])
        prev = durable.get(saves[i - 1]["step"]) if i else None
        save_rows.append({
            "step": s["step"],
            "last": s["last"],
            "blocking_s": s["t1"] - s["t0"],
            "done_s": (d["t"] - s["t0"]) if d else None,  # background work included
            "background_s": max(0.0, d["t"] - s["t1"]) if d else None,
            "error": d.get("error") if d else None,
            # The previous save's background work was still running when this save began.
            "previous_still_running": bool(prev and prev["t"] > s["t0"]),
            # Snapshot mode: what the steps paid while the snapshot persisted (server counts).
            **({k: d[k] for k in _SNAPSHOT_COUNTS if k in d} if d else {}),
        })  # fmt: skip
    windows = [(s["t1"], durable[s["step"]]["t"]) for s in saves if s["step"] in durable]
    after = {s["step"] + 1 for s in saves}
    classes: dict[str, list[float]] = {"all": [], "quiet": [], "after_save": [], "background": []}
    per_step = []
    for e in steps:
        dt = e["t1"] - e["t0"]
        if e["step"] <= WARMUP_STEPS:
            kind = "warmup"
        elif e["step"] in after:
            kind = "after_save"
        elif any(e["t0"] < end and e["t1"] > start for start, end in windows):
            kind = "background"
        else:
            kind = "quiet"
        per_step.append({"step": e["step"], "s": dt, "class": kind})
        if kind != "warmup":
            classes["all"].append(dt)
            classes[kind].append(dt)
    interval = [r for r in save_rows if not r["last"]]
    budget = next((e["session"] for e in reversed(events) if e["kind"] == "durable" and e.get("session")), {})
    return {
        "copy_budget": budget,
        "state": state,
        "saves": save_rows,
        "blocking_s": summarize([r["blocking_s"] for r in interval]),
        "done_s": summarize([r["done_s"] for r in interval if r["done_s"] is not None]),
        "saves_waiting_for_previous": sum(r["previous_still_running"] for r in interval),
        "step_s": {k: summarize(v) for k, v in classes.items()},
        "steps": per_step,
        "steps_run": len(steps),
        "end": next((e for e in events if e["kind"] == "end"), {}),
    }


# --------------------------------------------------------------------------- running
def _trainer_env(
    assets: Any, record: Path, flavors: dict[str, Any], stop_after: int, extra: dict[str, str]
) -> dict[str, str]:
    """The environment ``titan_testkit.launch`` gives the launcher, plus the recorder's."""
    kit = _testkit()
    pythonpath = [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return kit.launcher_env(assets, {
        "PYTHONPATH": os.pathsep.join(pythonpath),
        kit.STOP_AFTER_STEP_ENV: str(stop_after),
        kit.STOP_MODE_ENV: "return",
        RECORD_ENV: str(record),
        FLAVORS_ENV: json.dumps(flavors),
        **extra,
    }, drop=("SWAP_STATE_SERVER", "SWAP_STATE_JOB_ID"))  # fmt: skip


def _start_pinned_server(state_bytes: int, snapshot_dir: Path, cpus: list[int]):
    """A swap-state-server on ``cpus`` (it inherits this process's affinity while it starts),
    sized as the embedded default for whole-state snapshots is (1.5 x state + 32 MiB, plus
    copy slots for the whole state; 1 MiB chunks)."""
    from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig

    cow = -(-state_bytes // (1 << 20)) << 20
    config = EmbeddedServerConfig(
        shm_size_bytes=max(64 << 20, int(state_bytes * 1.5) + (32 << 20)) + cow,
        snapshot_dir=str(snapshot_dir),
        server={"cow_budget": cow, "log_level": "warning"},
    )
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        server = EmbeddedServer(config).start()
    finally:
        os.sched_setaffinity(0, saved)
    return server, config


def run_one(args: argparse.Namespace, assets: Any, work: Path, size: str, mode: str,
            pinned: dict[str, Any] | None = None) -> dict[str, Any]:
    kit = _testkit()
    spec = SIZES[size]
    interval = args.interval or spec["interval"]
    saves = MODES[mode][2]
    if interval < 2:
        raise SystemExit("--interval must be >= 2 (the run stops between two saves)")
    tail = min(4, interval - 1)  # steps after the last save, none of them a saving one
    stop_after = args.saves * interval + tail
    if not saves:
        stop_after = min(stop_after, WARMUP_STEPS + args.baseline_steps)  # step times only
    label = f"{size}/{mode}" + ("/pinned" if pinned else "")
    dump = work / label.replace("/", "-")
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    record = dump / "events.jsonl"
    record.write_text("")
    base = kit.base_flags(assets, dump, steps=stop_after + 1)  # +1: no last-step save (stopped before)
    flags = [
        *(f for f in base if not f.startswith(("--model.flavor=", "--checkpoint.no-enable"))),  # set below
        f"--model.flavor={spec['flavor']}",
        "--checkpoint.enable",
        f"--checkpoint.folder={CHECKPOINT_FOLDER}",
        f"--checkpoint.interval={interval}",
        "--checkpoint.no-last_save_model_only",
        "--checkpoint.keep_latest_k=0",
        *MODES[mode][1],
    ]
    flavors = {spec["flavor"]: spec["args"]} if spec["args"] else {}
    extra_env: dict[str, str] = {"OMP_NUM_THREADS": str(args.threads)}
    prefix: list[str] = []
    server = None
    if pinned:
        prefix = ["taskset", "-c", ",".join(map(str, pinned["trainer_cpus"]))]
        extra_env["OMP_NUM_THREADS"] = str(len(pinned["trainer_cpus"]))
        if mode == "snapshot":
            server, _ = _start_pinned_server(pinned["state_bytes"], dump / SNAPSHOT_SUBDIR, pinned["server_cpus"])
            flags.append(f"--optimizer.swap_state_server={server.address}")
    env = _trainer_env(assets, record, flavors, stop_after, extra_env)
    argv = [*prefix, sys.executable, str(TRAINER), *flags]
    log_path = work / f"{dump.name}.log"
    _log(f"{label}: {stop_after} steps, save every {interval}" + (f" (trainer on CPUs {pinned['trainer_cpus']}, "
         f"server on {pinned['server_cpus']})" if pinned else ""))
    cpu0, load0, ru0 = cpu_jiffies(), loadavg(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    error = None
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(argv, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout)
        if proc.returncode != 0:
            error = f"trainer exited {proc.returncode}"
    except subprocess.TimeoutExpired:
        error = f"trainer timed out after {args.run_timeout}s"
    finally:
        if server is not None:
            server.stop()
    wall = time.monotonic() - start
    cpu1, ru1 = cpu_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    result: dict[str, Any] = {
        "size": size, "mode": mode, "pinned": bool(pinned), "interval": interval,
        "steps": stop_after, "wall_s": wall, "error": error,
        "command": " ".join(shlex.quote(a) for a in [*prefix, "python", os.path.relpath(TRAINER, REPO), *flags]),
        "cpu_s": own,
        "other_cpu_s_per_s": max(0.0, (cpu1.get("busy", 0) - cpu0.get("busy", 0)) - own) / wall if cpu0 else None,
        "iowait_s_per_s": (cpu1.get("iowait", 0) - cpu0.get("iowait", 0)) / wall if cpu0 else None,
        "loadavg_start": load0, "loadavg_end": loadavg(),
    }  # fmt: skip
    result.update(analyze(_read_events(record)))
    result["peak_rss_bytes"] = result["end"].get("peak_rss_bytes")  # the trainer process's
    result["folders"] = _folders(dump)
    if error:
        tail_text = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
        result["log_tail"] = tail_text
        _log(f"{label}: FAILED ({error}); log {log_path}\n{tail_text}")
    else:
        b = result["blocking_s"]
        _log(f"{label}: {wall:.0f} s; save blocks median {fmt_ms(b.get('median'))} max {fmt_ms(b.get('max'))}; "
             f"quiet step {fmt_ms(result['step_s']['quiet'].get('median'))}; checkpoint folder "
             f"{fmt_bytes(result['folders']['checkpoint_bytes'])}")
    if not args.keep_work:
        shutil.rmtree(dump, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- report
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.titan_checkpoint", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--saves", type=int, default=3, help="interval saves per checkpointing run")
    p.add_argument("--interval", type=int, default=0, help="checkpoint.interval (0: the size's default)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the trainer (OMP_NUM_THREADS); 1 leaves a CPU to the server, DCP's "
                        "writer thread and anything else on a 2-CPU machine")
    p.add_argument("--baseline-steps", type=int, default=12,
                   help="steady steps of the swap_nockpt mode (it has no save to wait for)")
    p.add_argument("--pinned", default="", help="a size to rerun with the trainer on CPU 0 and the server on CPU 1 "
                                                "('' : none; needs 2 usable CPUs and taskset)")
    p.add_argument("--out", default="results", help="folder for titan-checkpoint.md and .json")
    p.add_argument("--work-dir", default=None, help="where the runs' dump folders go (default: --out); a scratch "
                                                    "folder inside it is removed at the end")
    p.add_argument("--disk-probe", default="256M", help="size of the disk write probe ('0': none)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one trainer run may take")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch folder (dump folders, logs)")
    return p


def run(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    """Run the measurement; returns the results (also written under ``args.out``)."""
    from bench import hardware
    from bench.report import write_json
    from bench.util import parse_size

    started = time.perf_counter()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for s in sizes + ([args.pinned] if args.pinned else []):
        if s not in SIZES:
            raise SystemExit(f"unknown size {s!r}: one of {', '.join(SIZES)}")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}: one of {', '.join(MODES)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.work_dir or out).resolve()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".titan-work-", dir=base))
    results: dict[str, Any] = {"machine": hardware.machine(str(work)), "sizes": []}
    try:
        probe = parse_size(args.disk_probe)
        if probe:
            disk = hardware.disk_bandwidth(str(work / "probe"), probe, reps=1)
            results["disk"] = {"write_fsync_gbps": _med(disk.get("write_fsync_gbps")), "probe_bytes": probe}
            shutil.rmtree(work / "probe", ignore_errors=True)
        assets = _testkit().build_titan_assets(work / "assets")
        plan: list[tuple[str, dict[str, Any] | None]] = [(s, None) for s in sizes]
        if args.pinned:
            plan.append((args.pinned, {}))
        for size, pinned in plan:
            runs = []
            if pinned is not None:
                cpus = sorted(os.sched_getaffinity(0))
                if len(cpus) < 2 or not shutil.which("taskset"):
                    _log(f"pinned run skipped: needs 2 usable CPUs and taskset (CPUs {cpus})")
                    results["pinned_skipped"] = f"usable CPUs {cpus}, taskset {shutil.which('taskset')}"
                    continue
                known = next((g["summary"]["whole_state_bytes"] for g in results["sizes"] if g["size"] == size), 0)
                pinned = {"trainer_cpus": cpus[:1], "server_cpus": cpus[1:2], "state_bytes": known}
                # The plain modes first: they tell the state's size, which the server is sized from.
                for mode in sorted((m for m in modes if m in CHECKPOINT_MODES), key=lambda m: m == "snapshot"):
                    if not pinned["state_bytes"]:
                        pinned["state_bytes"] = next(
                            (r["state"]["param_bytes"] + r["state"]["moment_bytes"] for r in runs if r.get("state")),
                            0) or (4 << 30)
                    runs.append(run_one(args, assets, work, size, mode, pinned))
            else:
                for mode in modes:
                    runs.append(run_one(args, assets, work, size, mode))
            group = {"size": size, "pinned": pinned is not None, "runs": runs}
            if pinned:
                group["cpus"] = {"trainer": pinned["trainer_cpus"], "server": pinned["server_cpus"]}
            group["summary"] = summarize_size(runs)
            results["sizes"].append(group)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    results["runtime_s"] = time.perf_counter() - started
    results["config"] = {
        "command": command or "python -m bench.titan_checkpoint",
        "sizes": sizes, "modes": modes, "saves": args.saves, "interval": args.interval, "threads": args.threads,
        "pinned": args.pinned, "size_specs": {s: SIZES[s] for s in sizes},
        "work_dir": str(work) if args.keep_work else None,
    }  # fmt: skip
    results["goals"] = evaluate_goals(results)
    md = markdown(results)
    (out / "titan-checkpoint.md").write_text(md)
    write_json(results, str(out / "titan-checkpoint.json"))
    print(md)
    print(f"wrote {out / 'titan-checkpoint.md'}, {out / 'titan-checkpoint.json'}; runtime {results['runtime_s']:.0f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = ("python -m bench.titan_checkpoint " + " ".join(shlex.quote(a) for a in argv)).strip()
    results = run(args, command)
    failed = [f"{r['size']}/{r['mode']}" for g in results["sizes"] for r in g["runs"] if r.get("error")]
    if failed:
        print(f"failed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
