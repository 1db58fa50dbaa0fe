"""``python -m bench``: what swap-state costs per step and per checkpoint, next to plain AdamW,
the in-process swap container, torch.save and DCP, and the hardware's own limits, in one run.

Per state size of the sweep (default: --params/16, --params/4, --params):

1. step time of plain fused AdamW, the in-process swap container and the remote container
   (interleaved, median and p10–p90, ratios);
2. step time while a snapshot persists vs without; copy-before-write and back-pressure counts;
3. trainer-visible checkpoint stall and time-to-durable: torch.save, DCP save, DCP
   async_save, swap-state snapshot();
4. persist and restore throughput;
5. unary RPCs per step (none: the step commit is a header word);
6. memory: server RSS split into shared memory and the rest, segment vs state bytes, trainer RSS.

Once per run: disk sequential write/read bandwidth, host memcpy and crc32 (the ceilings),
the step commit's cost on an idle session, and the CUDA section when a GPU is present.

Output under --out: bench.md (tables), bench.json (everything, raw samples included),
bench.png (step time and stall vs state size; skipped with a reason without matplotlib);
with --titan-checkpoint also titan-checkpoint.md/.json (bench/titan_checkpoint.py: torchtitan's
own trainer, CheckpointManager.save in snapshot mode vs plain sync and async).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any

from bench.util import (
    cpu_jiffies,
    fmt_bytes,
    fmt_count,
    fmt_ms,
    loadavg,
    own_cpu_seconds,
    paired_ratios,
    parse_size,
    summarize,
)

__all__ = ["main"]

MOMENT_BYTES_PER_PARAM = 8  # fp32 exp_avg + exp_avg_sq


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--params", default="16M", help="parameters of the largest (main) size; K/M/G suffixes (binary)")
    p.add_argument("--sweep", default="auto",
                   help="comma-separated parameter counts for the sweep ('auto': params/16, params/4, params; "
                        "'none': only --params)")
    p.add_argument("--out", default="results", help="folder for bench.md, bench.json, bench.png")
    p.add_argument("--work-dir", default=None,
                   help="folder on the disk under test for a scratch directory (checkpoints, snapshots, "
                        "the disk probe), created inside it and removed at the end (default: --out)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per optimizer and size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer before timing")
    p.add_argument("--block", type=int, default=1,
                   help="steps per optimizer per interleaving round (1: round-robin, the ratios pair "
                        "steps taken back to back)")
    p.add_argument("--batch", type=int, default=8, help="rows of the synthetic input per step")
    p.add_argument("--swap-times", type=int, default=16, help="slices of the swap pipeline (swap_optimizer_times)")
    p.add_argument("--snapshot-steps", type=int, default=None,
                   help="steps to time while a snapshot persists (default: --steps)")
    p.add_argument("--snapshot-seconds", type=float, default=60.0,
                   help="longest time spent on the snapshot-overlap measurement per size")
    p.add_argument("--ckpt-reps", type=int, default=5, help="repetitions of each checkpoint method")
    p.add_argument("--restore-reps", type=int, default=3, help="repetitions of restore (cold and warm each)")
    p.add_argument("--disk-reps", type=int, default=3, help="repetitions of the disk probe")
    p.add_argument("--commit-samples", type=int, default=1000, help="step commits (header words) timed on an idle session")
    p.add_argument("--chunk-bytes", default="1M", help="server --chunk-bytes (snapshot granularity, copy slot size)")
    p.add_argument("--cow-budget", default=None,
                   help="server --cow-budget (default: the embedded server's rule, max(4 chunks, shm-size/8)); "
                        "'state': the largest state's bytes (a pause-free snapshot at any disk speed)")
    p.add_argument("--isolate", action="store_true",
                   help="pin the server to its own CPU(s) and this process (the trainer) to the rest, torch "
                        "threads to match, as on a GPU host (os.sched_setaffinity; needs >= 2 usable CPUs)")
    p.add_argument("--server-cpus", type=int, default=1, help="CPUs the server gets with --isolate (the last ones)")
    p.add_argument("--persist-max-bandwidth", default="0", help="server --persist-max-bandwidth (0: unlimited)")
    p.add_argument("--cuda-params", default=None, help="parameters of the CUDA step section (default: --params)")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA section even with a GPU")
    p.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    p.add_argument("--keep-work", action="store_true", help="keep --work-dir afterwards")
    p.add_argument("--titan-checkpoint", nargs="?", const="debugmodel", default=None, metavar="SIZES",
                   help="also run bench.titan_checkpoint (torchtitan's CheckpointManager.save blocking time, "
                        "snapshot mode vs plain sync/async; minutes) at these sizes into --out "
                        "(titan-checkpoint.md/.json); off by default")
    return p


def _sizes(args: argparse.Namespace) -> list[int]:
    main = parse_size(args.params)
    if args.sweep == "none":
        sizes = [main]
    elif args.sweep == "auto":
        sizes = [main // 16, main // 4, main]
    else:
        sizes = [parse_size(s) for s in args.sweep.split(",") if s.strip()] + [main]
    return sorted({max(4096, s) for s in sizes})


def _start_server(args: argparse.Namespace, largest_state: int, work_dir: str):
    from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig

    chunk = parse_size(args.chunk_bytes)
    # Room for two of the largest segments: a closed session's segment is freed by the
    # server asynchronously, and the budget is only taken by segments that exist.
    shm_size = 2 * largest_state + (64 << 20)
    if args.cow_budget == "state":
        cow = -(-largest_state // chunk) * chunk
    else:
        cow = parse_size(args.cow_budget) if args.cow_budget else max(chunk * 4, shm_size // 8)
    shm_size += cow
    snapshot_dir = os.path.join(work_dir, "snapshots")
    config = EmbeddedServerConfig(
        shm_size_bytes=shm_size,
        snapshot_dir=snapshot_dir,
        server={"chunk_bytes": chunk, "cow_budget": cow, "log_level": "warning",
                "persist_max_bandwidth": parse_size(args.persist_max_bandwidth)},
    )  # fmt: skip
    isolation = None
    if args.isolate:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2 or not 1 <= args.server_cpus < len(cpus):
            raise SystemExit(f"--isolate needs more usable CPUs than --server-cpus {args.server_cpus}: "
                             f"this process may use {cpus}")
        isolation = {"server_cpus": cpus[-args.server_cpus:], "trainer_cpus": cpus[: -args.server_cpus]}
        os.sched_setaffinity(0, isolation["server_cpus"])  # the server process inherits this
    try:
        server = EmbeddedServer(config).start()
    finally:
        if isolation is not None:
            os.sched_setaffinity(0, cpus)
    if isolation is not None:
        isolation.update(_isolate(server.pid, isolation["server_cpus"], isolation["trainer_cpus"]))
    cfg = {"shm_size": shm_size, "chunk_bytes": chunk, "cow_budget": cow, "isolation": isolation}
    return server, snapshot_dir, cfg


def _pin_process(pid: int | str, cpus: list[int]) -> int:
    """Every thread of ``pid`` onto ``cpus`` (threads started later inherit it); threads pinned."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except (ProcessLookupError, PermissionError):
            pass
    return pinned


def _isolate(server_pid: int, server_cpus: list[int], trainer_cpus: list[int]) -> dict[str, Any]:
    """The server on its own CPU(s), the trainer (this process) and torch's threads on the rest."""
    import torch

    server_threads = _pin_process(server_pid, server_cpus)
    trainer_threads = _pin_process("self", trainer_cpus)
    torch.set_num_threads(len(trainer_cpus))
    _log(f"isolated: server pid {server_pid} ({server_threads} threads) on CPUs {server_cpus}; trainer on "
         f"{trainer_cpus} ({trainer_threads} threads), torch threads {torch.get_num_threads()}")
    return {"server_threads_pinned": server_threads, "torch_threads": torch.get_num_threads()}


def _step_stats(raw: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    return {v: {k: summarize(samples) for k, samples in kinds.items()} for v, kinds in raw.items()}


def run_size(args: argparse.Namespace, params: int, server: Any, snapshot_dir: str, work_dir: str) -> dict[str, Any]:
    import torch

    from bench import measure
    from bench.workload import VARIANTS, build_model, build_variant, model_shape, remote_container, timed_steps

    device = torch.device("cpu")
    width, layers = model_shape(params)
    base = build_model(params, device)
    actual = sum(p.numel() for p in base.parameters())
    state_bytes = actual * MOMENT_BYTES_PER_PARAM
    _log(f"size {fmt_count(actual)} params ({layers} x {width}^2), state {fmt_bytes(state_bytes)}: building optimizers")
    job_id = f"bench-{actual}-{os.getpid()}"
    variants = [build_variant(v, base, args.batch, device, args.swap_times, server.address, job_id) for v in VARIANTS]
    by_name = {v.name: v for v in variants}
    remote = by_name["remote"]
    try:
        _log(f"  step time: {args.steps} steps x {len(variants)} optimizers")
        raw = timed_steps(variants, args.steps, args.warmup, args.block)
        step = _step_stats(raw)
        # Ratios of steps of the same round (taken back to back): robust to load that comes
        # and goes on a shared machine, unlike a ratio of medians.
        paired = {
            f"{a}/{b}": {k: paired_ratios(raw[a][k], raw[b][k]) for k in ("train", "opt")}
            for a, b in (("remote", "inproc"), ("remote", "plain"), ("inproc", "plain"))
        }
        rpc = remote.rpc
        rpc.enabled = False
        n_steps = len(raw["remote"]["train"])
        rpc_result = {
            "steps": n_steps,
            "per_step": {name: count / n_steps for name, count in rpc.counts.items()},
            "counts": dict(rpc.counts),
            "commit_in_loop_s": summarize(rpc.latency.get("CommitStep", [])),
        }
        _log("  " + ", ".join(f"{v}: train {fmt_ms(step[v]['train']['median'])} opt {fmt_ms(step[v]['opt']['median'])}"
                              for v in VARIANTS))

        _log("  step time while snapshots persist")
        overlap = measure.snapshot_overlap(
            remote, args.snapshot_steps or args.steps, args.snapshot_seconds, server.pid
        )
        _log(f"  {overlap['snapshots']} snapshots, {overlap['steps_with']} steps overlapped; "
             f"opt step mean {fmt_ms(overlap['with_opt_s'].get('mean'))} with, {fmt_ms(overlap['without_opt_s'].get('mean'))} "
             f"without, max {fmt_ms(overlap['with_opt_s'].get('max'))}; trainer copies {overlap['cow_copies']} "
             f"({fmt_bytes(overlap['trainer_copied_bytes'])}), server staged {fmt_bytes(overlap['server_staged_bytes'])}, "
             f"back-pressure waits {overlap['backpressure_waits']}")

        _log(f"  checkpoint stall: torch.save, DCP save, DCP async_save, swap-state ({args.ckpt_reps} reps)")
        stall = measure.checkpoint_stalls(by_name["inproc"], remote, os.path.join(work_dir, "ckpt"), args.ckpt_reps)
        _log("  stall: " + ", ".join(f"{k} {fmt_ms(stall[k]['stall_s']['median'])}"
                                      for k in ("torch_save", "dcp_save", "dcp_async_save", "swap_state")))

        memory = measure.memory(remote, server.pid, state_bytes)

        _log(f"  restore ({args.restore_reps} reps, cold and warm)")

        def new_trainer(model=base):  # the job's next trainer: the same model, no step taken
            return remote_container(copy.deepcopy(model), device, args.swap_times, server.address, job_id)

        restore = measure.restore_throughput(
            remote, new_trainer, stall["swap_state"]["snapshot_ids"][-1], snapshot_dir,
            stall["swap_state"]["bytes_total"], args.restore_reps,
        )  # fmt: skip
        return {
            "params": actual,
            "requested_params": params,
            "state_bytes": state_bytes,
            "model": {"width": width, "layers": layers},
            "step": step,
            "step_paired_ratios": paired,
            "step_raw": raw,
            "rpc": rpc_result,
            "snapshot_overlap": overlap,
            "stall": stall,
            "restore": restore,
            "memory": memory,
            "rss_delta": {v.name: v.rss_delta for v in variants},
        }
    finally:
        for variant in variants:
            variant.close()
        del variants, by_name, remote, base
        gc.collect()


def run_cuda(args: argparse.Namespace, server: Any) -> dict[str, Any]:
    from bench import cuda

    reason = "disabled with --no-cuda" if args.no_cuda else cuda.skip_reason()
    if reason:
        _log(f"CUDA section skipped: {reason}")
        return {"skipped": reason}
    import torch

    from bench.workload import VARIANTS, build_model, build_variant, timed_steps

    params = parse_size(args.cuda_params or args.params)
    _log("CUDA: H2D/D2H bandwidth")
    copy = cuda.copy_bandwidth(max(64 << 20, min(params * MOMENT_BYTES_PER_PARAM, 1 << 30)))
    device = torch.device("cuda", torch.cuda.current_device())
    base = build_model(params, device)
    _log(f"CUDA: pipelined step, {fmt_count(params)} params")
    variants = [build_variant(v, base, args.batch, device, args.swap_times, server.address, f"bench-cuda-{os.getpid()}")
                for v in VARIANTS]
    try:
        raw = timed_steps(variants, args.steps, args.warmup, args.block)
    finally:
        for v in variants:
            v.close()
    paired = {
        f"{a}/{b}": {k: paired_ratios(raw[a][k], raw[b][k]) for k in ("train", "opt")}
        for a, b in (("remote", "inproc"), ("remote", "plain"), ("inproc", "plain"))
    }
    return {
        "params": sum(p.numel() for p in base.parameters()),
        "copy": copy,
        "step": _step_stats(raw),
        "step_paired_ratios": paired,
        "step_raw": raw,
    }


def _contention(cpu_start: dict[str, float], own_start: float, load_start: list[float], wall: float) -> dict[str, Any]:
    """How busy the machine was with other work during the run: machine-wide busy CPU time
    minus this process's and its server's, per second of the run."""
    cpu_end = cpu_jiffies()
    if not cpu_start or not cpu_end or wall <= 0:
        return {}
    own = own_cpu_seconds() - own_start
    busy = cpu_end["busy"] - cpu_start["busy"]
    return {
        "own_cpu_s_per_s": own / wall,
        "other_cpu_s_per_s": max(0.0, busy - own) / wall,
        "steal_s_per_s": (cpu_end["steal"] - cpu_start["steal"]) / wall,
        "iowait_s_per_s": (cpu_end["iowait"] - cpu_start["iowait"]) / wall,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    from bench import allocate, hardware, measure, report

    sizes = _sizes(args)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    scratch_base = os.path.abspath(args.work_dir or out_dir)
    os.makedirs(scratch_base, exist_ok=True)
    work_dir = tempfile.mkdtemp(prefix=".bench-work-", dir=scratch_base)  # only this is ever removed
    command = "python -m bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    command = command.strip()
    largest_state = max(sizes) * MOMENT_BYTES_PER_PARAM
    server_state = largest_state
    if not args.no_cuda and args.cuda_params:
        server_state = max(server_state, parse_size(args.cuda_params) * MOMENT_BYTES_PER_PARAM)
    results: dict[str, Any] = {"machine": hardware.machine(work_dir)}
    cpu_start, own_start, load_start = cpu_jiffies(), own_cpu_seconds(), loadavg()
    _log(f"sizes {', '.join(fmt_count(s) for s in sizes)} params; out {out_dir}; scratch {work_dir}")
    try:
        _log("ceilings: host memcpy, crc32, disk sequential write/read")
        results["memcpy"] = hardware.memcpy_bandwidth(max(64 << 20, min(largest_state, 256 << 20)))
        results["crc32"] = hardware.crc32_bandwidth(min(max(largest_state, 1 << 20), 64 << 20))
        results["fresh_memory"] = hardware.fresh_memory_bandwidth(max(64 << 20, min(largest_state, 512 << 20)))
        results["disk"] = hardware.disk_bandwidth(os.path.join(work_dir, "probe"), max(largest_state, 8 << 20), args.disk_reps)
        _log(f"  memcpy {results['memcpy']['torch_copy_gbps']['median']:.2f} GB/s, "
             f"disk write+fsync {results['disk']['write_fsync_gbps']['median']:.2f} GB/s, "
             f"cold read {results['disk']['read_cold_gbps']['median']:.2f} GB/s")
        server, snapshot_dir, server_cfg = _start_server(args, server_state, work_dir)
        try:
            results["sizes"] = [run_size(args, s, server, snapshot_dir, work_dir) for s in sizes]
            _log(f"control plane: {args.commit_samples} step commits on an idle session")
            results["control_plane"] = measure.commit_latency(server.address, args.commit_samples)
            results["cuda"] = run_cuda(args, server)
        finally:
            server.stop()
        # Last: it allocates and frees several times the state, and on a VM memory freed a while
        # ago is slower to touch again (the sections above would pay for it).
        alloc_bytes = max(64 << 20, min(4 * largest_state, 2 << 30))
        _log(f"allocation: one rank and 4 ranks at once of {fmt_bytes(alloc_bytes)}, beside tmpfs's own")
        results["allocate"] = allocate.measure(argparse.Namespace(size=alloc_bytes, ranks=4, reps=max(3, args.disk_reps)))
    finally:
        if not args.keep_work:
            shutil.rmtree(work_dir, ignore_errors=True)
    results["runtime_s"] = time.perf_counter() - started
    results["machine"]["contention"] = _contention(cpu_start, own_start, load_start, results["runtime_s"])
    results["config"] = {
        "command": command,
        "params": parse_size(args.params),
        "sizes": sizes,
        "steps": args.steps,
        "warmup": args.warmup,
        "block": args.block,
        "batch": args.batch,
        "swap_times": args.swap_times,
        "ckpt_reps": args.ckpt_reps,
        "restore_reps": args.restore_reps,
        "persist_max_bandwidth": parse_size(args.persist_max_bandwidth),
        **server_cfg,
    }
    results["goals"] = report.evaluate_goals(results)

    md = report.markdown(results)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(md)
    report.write_json(results, os.path.join(out_dir, "bench.json"))
    plot_note = "disabled with --no-plot" if args.no_plot else report.plot(results, os.path.join(out_dir, "bench.png"))

    print(md)
    print("Summary against the issue's goals:")
    for g in results["goals"]:
        mark = {True: "REACHED", False: "SHORT  ", None: "n/a    "}[g["reached"]]
        unresolved = "" if g.get("resolved", True) else " (unresolved: the goal is inside the 95% interval)"
        print(f"  [{mark}] {g['goal']}: {g['measured']}{unresolved}")
        if g["why"]:
            print(f"            why: {g['why']}")
    print(f"\nwrote {os.path.join(out_dir, 'bench.md')}, {os.path.join(out_dir, 'bench.json')}"
          + (f"; bench.png skipped: {plot_note}" if plot_note else f", {os.path.join(out_dir, 'bench.png')}"))
    print(f"runtime {results['runtime_s']:.0f} s")
    if args.titan_checkpoint:
        from bench import titan_checkpoint

        return titan_checkpoint.main(["--sizes", args.titan_checkpoint, "--out", out_dir,
                                      "--work-dir", scratch_base])
    return 0
