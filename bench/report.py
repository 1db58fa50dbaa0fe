"""Results -> markdown tables, JSON and a PNG plot. The summary against the issue's goals
is :mod:`bench.goals` (``evaluate_goals`` is re-exported here for the CLI)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from bench.goals import _ci, _gb, _med, _pct, _ratio, _spread, _x, evaluate_goals
from bench.util import fmt_bytes, fmt_count, fmt_ms

__all__ = ["evaluate_goals", "markdown", "plot", "run_small_bench", "write_json"]


# --------------------------------------------------------------------------- markdown
def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    disk = m["disk"]
    sizes = results["sizes"]
    main = sizes[-1]
    lines: list[str] = []
    add = lines.append
    disk_desc = ", ".join(
        str(x)
        for x in (
            disk.get("model"), disk.get("bus"), fmt_bytes(disk["size_bytes"]) if disk.get("size_bytes") else None,
            f"{disk.get('fstype')} on {disk.get('device')}",
            None if str(disk.get("bus", "")).startswith("virtio")
            else ("rotational" if disk.get("rotational") else ("non-rotational" if disk.get("rotational") is False else None)),
        )
        if x
    )
    add("# swap-state benchmark")
    add("")
    add(f"- **Machine**: {m['cpu_model']}, {m['cpus_usable']} CPUs usable (torch threads {m['torch_threads']}), "
        f"{fmt_bytes(m['ram_bytes'])} RAM, /dev/shm {fmt_bytes(m['dev_shm_bytes'] or 0)}; disk: {disk_desc}; "
        f"GPU: {m['cuda'] or 'none'}")
    add(f"- **Software**: Linux {m['kernel']}, Python {m['python']}, torch {m['torch']}, torchtitan {m['torchtitan']}, "
        f"swap-state {m['swap_state']}")
    c = m.get("contention") or {}
    if c:
        add(f"- **Other load during the run**: other processes used {c['other_cpu_s_per_s']:.2f} CPU-s/s of the "
            f"{m['cpus_usable']} CPUs (this benchmark and its server {c['own_cpu_s_per_s']:.2f}); steal "
            f"{c['steal_s_per_s']:.2f}, iowait {c['iowait_s_per_s']:.2f} CPU-s/s; load average "
            f"{' '.join(f'{v:.1f}' for v in c['loadavg_start'][:1])} at start, "
            f"{' '.join(f'{v:.1f}' for v in c['loadavg_end'][:1])} at end")
    cfg = results["config"]
    add(f"- **Run**: `{cfg['command']}` — {results['runtime_s']:.0f} s; {cfg['steps']} timed steps per optimizer "
        f"(after {cfg['warmup']} warm-up, interleaved in blocks of {cfg['block']}), batch {cfg['batch']}, "
        f"swap slices {cfg['swap_times']}; server: --chunk-bytes {fmt_bytes(cfg['chunk_bytes'])}, "
        f"--cow-budget {fmt_bytes(cfg['cow_budget'])}, --persist-max-bandwidth "
        f"{cfg['persist_max_bandwidth'] or 'unlimited'}")
    add(f"- **Main size**: {fmt_count(main['params'])} parameters ({main['model']['layers']} × Linear "
        f"{main['model']['width']}²), {fmt_bytes(main['state_bytes'])} of Adam moments (fp32 exp_avg + exp_avg_sq). "
        "Times: median [p10–p90]. One process, CPU device unless the CUDA section says otherwise.")
    add("")

    add(f"## Step time ({fmt_count(main['params'])} params)")
    add("")
    add("| | plain fused AdamW (moments resident) | in-process swap container | remote container (swap-state) |")
    add("|---|---|---|---|")
    st = main["step"]
    pr = main["step_paired_ratios"]
    for kind, name in (("train", "train step (fwd+bwd+step+zero_grad)"), ("opt", "optimizer step only")):
        add(f"| {name} | {_spread(st['plain'][kind])} | {_spread(st['inproc'][kind])} | {_spread(st['remote'][kind])} |")
        add(f"| {kind} step ÷ plain, paired [95% CI] | 1 | {_ci(pr['inproc/plain'][kind])} | "
            f"{_ci(pr['remote/plain'][kind])}; ÷ in-process: {_ci(pr['remote/inproc'][kind])} |")
    add("")
    add("Ratios are paired: the median over rounds of the ratio of two optimizers' steps taken back to back "
        "(round-robin, the order rotating), with a bootstrap 95% interval; load from other processes comes "
        "and goes on this machine and hits both steps of a pair alike, which a ratio of medians does not.")
    add("")
    ov = main["snapshot_overlap"]
    iso = (results.get("config") or {}).get("isolation")
    add("## Step time while a snapshot persists (remote container)")
    add("")
    add(("Isolated: server on CPUs " + ", ".join(map(str, iso["server_cpus"])) + ", trainer on "
         + ", ".join(map(str, iso["trainer_cpus"])) + f" with {iso.get('torch_threads')} torch thread(s). ")
        if iso else "Not isolated (server and trainer share every CPU; `--isolate` pins them apart). ")
    add("")
    add("| | without snapshot: mean / p99 / max | while a snapshot persists: mean / p99 / max | "
        "first step after snapshot(): mean / max | with ÷ mean without: mean / p99 / max | paired per snapshot [95% CI] |")
    add("|---|---|---|---|---|---|")
    for kind, name in (("train", "train step"), ("opt", "optimizer step")):
        wo, wi, fi = ov[f"without_{kind}_s"], ov[f"with_{kind}_s"], ov[f"first_step_after_snapshot_{kind}_s"]
        r = ov[f"ratio_{kind}"]
        add(f"| {name} | {fmt_ms(wo.get('mean'))} / {fmt_ms(wo.get('p99'))} / {fmt_ms(wo.get('max'))} | "
            f"{fmt_ms(wi.get('mean'))} / {fmt_ms(wi.get('p99'))} / {fmt_ms(wi.get('max'))} | "
            f"{fmt_ms(fi.get('mean'))} / {fmt_ms(fi.get('max'))} | "
            f"{_x(r['mean'])} / {_x(r['p99'])} / {_x(r['max'])} | {_ci(ov[f'paired_ratio_{kind}'])} |")
    add("")
    per_step = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ov.get("unary_rpcs_per_step", {}).items())) or "none"
    add(f"{ov['snapshots']} snapshots, {ov['steps_with']} steps overlapped a persisting snapshot "
        f"(per snapshot: {', '.join(map(str, ov['steps_per_snapshot'][:12]))}{'…' if len(ov['steps_per_snapshot']) > 12 else ''}); "
        f"snapshot() {fmt_ms(ov['snapshot_call_s'].get('mean'))} mean, {fmt_ms(ov['snapshot_call_s'].get('max'))} max; "
        f"snapshot → durable while training: {_spread(ov['snapshot_to_durable_while_training_s'])}. "
        f"Copies, summed over the snapshots: the trainer copied **{fmt_bytes(ov.get('trainer_copied_bytes', 0))}** "
        f"({ov['cow_copies']} chunks) itself, the server staged **{fmt_bytes(ov.get('server_staged_bytes', 0))}** "
        f"({ov.get('server_staged_chunks', 0)} chunks) ahead of it; back-pressure waits **{ov['backpressure_waits']}** "
        f"({ov['backpressure_wait_s'] * 1e3:.1f} ms). Unary RPCs per timed step: {per_step}. "
        f"Server CPU while persisting: {ov.get('server_cpu_s_per_s', float('nan')):.2f} CPU-s/s; whole machine busy "
        f"{ov.get('machine_busy_cpu_s_per_s_with', float('nan')):.2f} CPU-s/s while persisting, "
        f"{ov.get('machine_busy_cpu_s_per_s_without', float('nan')):.2f} without.")
    add("")

    sk = main["stall"]
    add(f"## Checkpoint of the same optimizer state ({fmt_bytes(sk['state_dict_tensor_bytes'])} of tensors, "
        f"median of {sk['reps']})")
    add("")
    add("| method | trainer-visible stall | until durable |")
    add("|---|---|---|")
    names = {
        "torch_save": "`torch.save` (durable after the trainer's own fsync)",
        "dcp_save": "DCP `save` (fsyncs)",
        "dcp_async_save": "DCP `async_save` (blocking part = staging)",
        "swap_state": "swap-state `snapshot()` (one RPC)",
    }
    for key, name in names.items():
        add(f"| {name} | {_spread(sk[key]['stall_s'])} | {_spread(sk[key]['durable_s'])} |")
    add("")

    d = results["disk"]
    mc = results["memcpy"]
    rs = main["restore"]
    persist = sk["swap_state"]["persist_gbps"]
    add(f"## Throughput vs the hardware ({fmt_count(main['params'])} params; GB/s = 10⁹ B/s; disk probe file "
        f"{fmt_bytes(d['bytes'])} at the start of the run, median of {d['reps']})")
    add("")
    add("| | GB/s | note |")
    add("|---|---|---|")
    add(f"| disk sequential write, buffered + fsync | {_gb(d.get('write_fsync_gbps'))} | |")
    add(f"| disk sequential write, page cache only (no fsync) | {_gb(d.get('write_pagecache_only_gbps'))} | not durable: memory speed |")
    if d.get("write_direct_gbps"):
        add(f"| disk sequential write, O_DIRECT + fsync | {_gb(d.get('write_direct_gbps'))} | |")
    add(f"| disk sequential read, cold (fadvise DONTNEED first) | {_gb(d.get('read_cold_gbps'))} | |")
    if d.get("read_direct_gbps"):
        add(f"| disk sequential read, O_DIRECT | {_gb(d.get('read_direct_gbps'))} | |")
    add(f"| disk sequential read, warm (page cache) | {_gb(d.get('read_warm_gbps'))} | |")
    ceiling = max(_med(mc["torch_copy_gbps"]), _med(mc["memmove_1thread_gbps"]))
    add(f"| host memcpy, torch `copy_` ({mc['torch_threads']} threads) | {_gb(mc['torch_copy_gbps'])} | "
        f"{fmt_bytes(mc['bytes'])} buffers |")
    add(f"| host memmove, 1 thread | {_gb(mc['memmove_1thread_gbps'])} | |")
    add(f"| crc32 ({results['crc32'].get('implementation', 'zlib')}), 1 thread | {_gb(results['crc32']['gbps'])} | every persisted/restored byte |")
    fresh = results.get("fresh_memory")
    if fresh:
        add(f"| fresh anonymous memory, faulted in and zeroed (1 thread) | {_gb(fresh['populate_gbps'])} | "
            f"{fmt_bytes(fresh['bytes'])}, freed in {fmt_ms(_med(fresh['munmap_s']))}: what restore's staging costs "
            "beside the disk |")
    ref = sk["disk_ref"]
    add(f"| disk write + fsync, {fmt_bytes(sk['state_dict_tensor_bytes'])}, right before and after each snapshot | "
        f"{_gb(ref['write_fsync_gbps'])} | the reference for persist (same bytes, same moment) |")
    add(f"| disk cold read, {fmt_bytes(sk['state_dict_tensor_bytes'])}, right before and after each snapshot | "
        f"{_gb(ref['read_cold_gbps'])} | a freshly written file |")
    add(f"| disk O_DIRECT write + fsync, same bytes, same moment | {_gb(ref.get('write_direct_gbps'))} | "
        "the disk's own limit: the reference for persist |")
    add(f"| **swap-state persist** (snapshot() → durable, idle trainer) | **{_gb(persist)}** | "
        f"{_pct(_ratio(_med(persist), _med(ref.get('write_direct_gbps'))))} of O_DIRECT write, "
        f"{_pct(_ratio(_med(persist), _med(ref['write_fsync_gbps'])))} of buffered write, "
        f"{_pct(_ratio(_med(persist), ceiling))} of the memcpy ceiling ({ceiling:.2f}) |")
    add(f"| cold read of the snapshot's own file, right before each restore | {_gb(rs.get('file_cold_read_gbps'))} | "
        "buffered, same file, same moment |")
    add(f"| O_DIRECT read of the snapshot's own file, right before each restore | "
        f"{_gb(rs.get('file_direct_read_gbps'))} | the disk's own limit: the reference for restore |")
    if rs.get("new_trainer_gbps"):
        new = _med(rs["new_trainer_gbps"])
        add(f"| **swap-state restore, a new trainer's** (its segment fresh), cold | **{_gb(rs['new_trainer_gbps'])}** | "
            f"{_pct(_ratio(new, _med(rs.get('new_trainer_file_direct_read_gbps'))))} of the file's O_DIRECT read "
            f"right before each ({_gb(rs.get('new_trainer_file_direct_read_gbps'))}): read straight into the segment |")
    add(f"| **swap-state restore, the running trainer's** (a committed step kept), cold | **{_gb(rs['cold_gbps'])}** | "
        f"{_pct(_ratio(_med(rs['cold_gbps']), _med(rs.get('file_direct_read_gbps'))))} of the file's O_DIRECT read, "
        f"{_pct(_ratio(_med(rs['cold_gbps']), _med(rs.get('file_cold_read_gbps'))))} of its cold buffered read: "
        "its kept bytes copied aside first, the file read once and copied in as verified |")
    add(f"| swap-state restore, the running trainer's, just read again | {_gb(rs['warm_gbps'])} | "
        f"{_pct(_ratio(_med(rs['warm_gbps']), _med(d.get('read_warm_gbps'))))} of warm read |")
    if d.get("notes"):
        add("")
        add("Disk notes: " + "; ".join(d["notes"]))
    add("")

    rpc = main["rpc"]
    cl = results["control_plane"]
    per_step = ", ".join(f"{k} {v:.2f}" for k, v in sorted(rpc["per_step"].items())) or "none"
    add("## Control plane (gRPC over the Unix socket)")
    add("")
    add("| | value |")
    add("|---|---|")
    add(f"| unary RPCs per training step (by name) | {per_step} (+ one KeepAlive stream per session, not per step) |")
    add(f"| CommitStep RPC latency in the training loop (the container commits through the header), p50 / p99 (n={rpc['commit_in_loop_s'].get('n', 0)}) | "
        f"{fmt_ms(rpc['commit_in_loop_s'].get('median'))} / {fmt_ms(rpc['commit_in_loop_s'].get('p99'))} |")
    add(f"| step commit (header words, no RPC), idle session, p50 / p99 / max (n={cl['samples']}) | "
        f"{fmt_ms(cl['commit_s']['median'])} / {fmt_ms(cl['commit_s']['p99'])} / {fmt_ms(cl['commit_s']['max'])} |")
    add("")

    mem = main["memory"]
    srv, tr = mem["server"], mem["trainer"]
    deltas = main["rss_delta"]
    add(f"## Memory ({fmt_count(main['params'])} params, remote container attached)")
    add("")
    add("| | bytes |")
    add("|---|---|")
    add(f"| Adam state (exp_avg + exp_avg_sq) | {fmt_bytes(mem['state_bytes'])} |")
    add(f"| shared-memory segment (header {fmt_bytes(mem['header_bytes'])} + tensors + {mem['cow_slots']} copy slots × "
        f"{fmt_bytes(mem['chunk_bytes'])}) | {fmt_bytes(mem['segment_bytes'])} "
        f"({_x(_ratio(mem['segment_bytes'], mem['state_bytes']), 3)}× state); server budget used "
        f"{fmt_bytes(mem['server_budget_used_bytes'])} |")
    add(f"| server RSS outside shm (RssAnon + RssFile) | {fmt_bytes(mem['server_rss_outside_shm_bytes'])} "
        f"(anon {fmt_bytes(srv.get('RssAnon', 0))}, file {fmt_bytes(srv.get('RssFile', 0))}) |")
    add(f"| server RssShmem (its mapping of the segments) | {fmt_bytes(srv.get('RssShmem', 0))} |")
    add(f"| trainer RSS (all three optimizers' models alive) | {fmt_bytes(tr.get('VmRSS', 0))} "
        f"(anon {fmt_bytes(tr.get('RssAnon', 0))}, shmem {fmt_bytes(tr.get('RssShmem', 0))}) |")
    add(f"| trainer RSS growth for the optimizer state (anon / shmem) | plain {fmt_bytes(deltas['plain'].get('RssAnon', 0))} / "
        f"{fmt_bytes(deltas['plain'].get('RssShmem', 0))}; in-process {fmt_bytes(deltas['inproc'].get('RssAnon', 0))} / "
        f"{fmt_bytes(deltas['inproc'].get('RssShmem', 0))}; remote {fmt_bytes(deltas['remote'].get('RssAnon', 0))} / "
        f"{fmt_bytes(deltas['remote'].get('RssShmem', 0))} |")
    add("")

    add("## Sweep over state sizes")
    add("")
    add("| params | state | train step plain / in-proc / remote (medians) | remote÷in-proc (paired) | remote÷plain (paired) | "
        "stall: torch.save / DCP save / DCP async / swap-state | durable: torch.save+fsync / DCP / DCP async / swap-state | "
        "persist GB/s (% of O_DIRECT write) | restore cold GB/s (% of O_DIRECT read) |")
    add("|---|---|---|---|---|---|---|---|---|")
    for s in sizes:
        st, sk = s["step"], s["stall"]
        med = {v: _med(st[v]["train"]) for v in ("plain", "inproc", "remote")}
        stalls = " / ".join(fmt_ms(_med(sk[k]["stall_s"])) for k in names)
        durables = " / ".join(fmt_ms(_med(sk[k]["durable_s"])) for k in names)
        add(f"| {fmt_count(s['params'])} | {fmt_bytes(s['state_bytes'])} | "
            f"{' / '.join(fmt_ms(med[v]) for v in ('plain', 'inproc', 'remote'))} | "
            f"{_x(_med(s['step_paired_ratios']['remote/inproc']['train']))} | "
            f"{_x(_med(s['step_paired_ratios']['remote/plain']['train']))} | "
            f"{stalls} | {durables} | {_gb(sk['swap_state']['persist_gbps'])} "
            f"({_pct(_ratio(_med(sk['swap_state']['persist_gbps']), _med(sk['disk_ref'].get('write_direct_gbps'))))}) | "
            f"{_gb(s['restore']['cold_gbps'])} "
            f"({_pct(_ratio(_med(s['restore']['cold_gbps']), _med(s['restore'].get('file_direct_read_gbps'))))}) |")
    add("")

    add("## CUDA")
    add("")
    cuda = results["cuda"]
    if cuda.get("skipped"):
        add(f"Skipped: {cuda['skipped']}.")
    else:
        bw = cuda["copy"]
        add(f"| host memory ({fmt_bytes(bw['bytes'])}) | H2D GB/s | D2H GB/s |")
        add("|---|---|---|")
        for key, name in (("registered_shm", "/dev/shm mapping, cudaHostRegister"), ("pin_memory", "pin_memory"), ("pageable", "pageable")):
            add(f"| {name} | {_gb(bw[key]['h2d_gbps'])} | {_gb(bw[key]['d2h_gbps'])} |")
        add("")
        st = cuda["step"]
        add(f"Pipelined step on {m['cuda']} ({fmt_count(cuda['params'])} params):")
        add("")
        add("| | plain fused AdamW (moments on GPU) | in-process swap | remote swap |")
        add("|---|---|---|---|")
        pr = cuda["step_paired_ratios"]
        for kind in ("train", "opt"):
            add(f"| {kind} step | {_spread(st['plain'][kind])} | {_spread(st['inproc'][kind])} | {_spread(st['remote'][kind])} |")
            add(f"| {kind} ÷ plain, paired [95% CI] | 1 | {_ci(pr['inproc/plain'][kind])} | "
                f"{_ci(pr['remote/plain'][kind])}; ÷ in-process: {_ci(pr['remote/inproc'][kind])} |")
    add("")

    add("## Against the issue's goals")
    add("")
    add("| goal | measured | reached | why short (measured) |")
    add("|---|---|---|---|")
    for g in results["goals"]:
        reached = {True: "yes", False: "**no**", None: "n/a"}[g["reached"]]
        if g["reached"] is not None and not g.get("resolved", True):
            reached += " (unresolved†)"
        add(f"| {g['goal']} | {g['measured']} | {reached} | {g['why']} |")
    add("")
    if any(not g.get("resolved", True) for g in results["goals"]):
        add("† unresolved: the goal lies inside the 95% interval of the measured ratio, so this run cannot "
            "tell reached from short (more steps, or a quieter machine, would).")
        add("")
    add("Page cache: persist and DCP/torch.save times include fsync, so they are disk-bound; restore is "
        "shown cold (the snapshot's pages evicted with posix_fadvise first) and warm. On a virtual disk the "
        "hypervisor may cache below the guest, which the guest cannot evict.")
    return "\n".join(lines) + "\n"


def _finite(value: Any) -> Any:
    """NaN/inf -> None, so that the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(results: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(_finite(results), f, indent=1, default=str, allow_nan=False)
        f.write("\n")


def small_bench_parser(module: str, doc: str, stem: str) -> argparse.ArgumentParser:
    """The parser of a one-question benchmark: ``python -m <module>``, its docstring's first
    paragraph, defaults shown, and ``--out`` for ``<stem>.md`` and ``<stem>.json``; the
    benchmark adds its own arguments."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="results", help=f"folder for {stem}.md and {stem}.json")
    return parser


def run_small_bench(argv: list[str] | None, parser: Any, measure: Any, to_markdown: Any, stem: str) -> int:
    """``main`` of the one-question benchmarks (``bench.restart``, ``bench.quiet_steps``,
    ``bench.allocate``): parse ``argv``, measure, write ``<stem>.md`` and ``<stem>.json`` under
    ``--out``, print the table."""
    args = parser.parse_args(argv)
    result = measure(args)
    os.makedirs(args.out, exist_ok=True)
    text = to_markdown(result)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(text)
    write_json(result, os.path.join(args.out, f"{stem}.json"))
    print(text)
    return 0


def plot(results: dict[str, Any], path: str) -> str | None:
    """PNG of step time and checkpoint stall vs state size; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the 'bench' extra)"
    sizes = results["sizes"]
    x = [s["state_bytes"] / (1 << 20) for s in sizes]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, label, color in (("plain", "plain fused AdamW", "C0"), ("inproc", "in-process swap", "C1"),
                                  ("remote", "remote (swap-state)", "C2")):
        for kind, style in (("train", "-o"), ("opt", "--s")):
            med = [_med(s["step"][variant][kind]) * 1e3 for s in sizes]
            lo = [m - s["step"][variant][kind]["p10"] * 1e3 for m, s in zip(med, sizes)]
            hi = [s["step"][variant][kind]["p90"] * 1e3 - m for m, s in zip(med, sizes)]
            ax1.errorbar(x, med, yerr=[lo, hi], fmt=style, color=color, capsize=3,
                         label=f"{label} ({'train step' if kind == 'train' else 'optimizer step'})")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(x, [fmt_bytes(s["state_bytes"]) for s in sizes])
        ax.minorticks_off()
    ax1.set_yscale("log")
    ax1.set_xlabel("Adam state (fp32 moments)")
    ax1.set_ylabel("step time (ms), median, p10–p90")
    ax1.set_title("Step time vs state size")
    ax1.legend(fontsize=7, loc="lower right")
    for key, label, color in (("torch_save", "torch.save", "C3"), ("dcp_save", "DCP save", "C4"),
                              ("dcp_async_save", "DCP async_save (blocking)", "C5"),
                              ("swap_state", "swap-state snapshot()", "C2")):
        ax2.plot(x, [_med(s["stall"][key]["stall_s"]) * 1e3 for s in sizes], "-o", color=color, label=f"{label}: stall")
        ax2.plot(x, [_med(s["stall"][key]["durable_s"]) * 1e3 for s in sizes], ":", color=color, label=f"{label}: durable")
    ax2.axhline(5, color="grey", lw=0.8, ls="--", label="5 ms goal")
    ax2.set_yscale("log")
    ax2.set_xlabel("Adam state (fp32 moments)")
    ax2.set_ylabel("ms (median)")
    ax2.set_title("Checkpoint: trainer-visible stall (solid), time to durable (dotted)")
    ax2.legend(fontsize=7, loc="upper left")
    m = results["machine"]
    fig.suptitle(f"swap-state bench — {m['cpu_model']}, {m['cpus_usable']} CPUs, {fmt_bytes(m['ram_bytes'])} RAM", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
