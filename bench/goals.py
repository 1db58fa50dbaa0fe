"""The benchmark's results against the issue's goals: reached or not, with the measured
reason where short. Nothing here asserts a threshold. Also the number formatting the report
and the goals share."""

from __future__ import annotations

import math
from typing import Any

from bench.util import fmt_bytes, fmt_count, fmt_ms

__all__ = ["evaluate_goals"]


def _med(stats: dict[str, float] | None) -> float:
    return stats.get("median", float("nan")) if stats else float("nan")


def _spread(stats: dict[str, float]) -> str:
    if not stats or not stats.get("n"):
        return "n/a"
    return f"{fmt_ms(stats['median'])} [{fmt_ms(stats['p10'])}–{fmt_ms(stats['p90'])}]"


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def _x(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _gb(stats: dict[str, float] | None) -> str:
    if not stats or not stats.get("n"):
        return "n/a"
    return f"{stats['median']:.2f}"


def _ci(stats: dict[str, Any]) -> str:
    if not stats or not stats.get("n"):
        return "n/a"
    lo, hi = stats.get("ci95", (float("nan"), float("nan")))
    return f"{_x(stats['median'])} [{_x(lo)}–{_x(hi)}]"


def _pct(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


# --------------------------------------------------------------------------- goals
def _disk_write(disk: dict[str, Any]) -> float:
    return _med(disk.get("write_fsync_gbps"))


def _disk_read(disk: dict[str, Any]) -> float:
    return _med(disk.get("read_cold_gbps"))


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per goal of the issue: what was measured, whether it is reached, and where
    short, the measured facts that explain it."""
    sizes = results["sizes"]
    main = sizes[-1]
    goals: list[dict[str, Any]] = []
    label = f"at {fmt_count(main['params'])} params"
    step = main["step"]
    commit_p50 = _med(main["rpc"]["commit_in_loop_s"])
    rpc_text = ", ".join(f"{k} {v:.2f}" for k, v in sorted(main["rpc"]["per_step"].items())) or "none"
    if main["rpc"]["per_step"].get("CommitStep"):
        rpc_text += f"; CommitStep p50 {fmt_ms(commit_p50)} in this loop"

    def add(goal: str, measured: str, reached: bool | None, why: str = "", resolved: bool = True) -> None:
        goals.append({"goal": goal, "measured": measured, "reached": reached, "resolved": resolved,
                      "why": "" if reached else why})


    def ci_text(stats: dict[str, Any]) -> str:
        lo, hi = stats.get("ci95", (float("nan"), float("nan")))
        return f"95% CI {_x(lo)}–{_x(hi)}"

    def verdict(stats: dict[str, Any], target: float) -> tuple[bool | None, bool]:
        """(reached by the median, resolved: the 95% interval lies on one side of the goal)."""
        r = stats.get("median", float("nan"))
        lo, hi = stats.get("ci95", (float("nan"), float("nan")))
        if math.isnan(r):
            return None, False
        return r <= target, not (math.isnan(lo) or lo <= target < hi)

    for kind, name in (("opt", "optimizer step"), ("train", "train step")):
        remote, inproc, plain = (_med(step[v][kind]) for v in ("remote", "inproc", "plain"))
        medians = (f"medians {label}: plain {fmt_ms(plain)}, in-process {fmt_ms(inproc)}, "
                   f"remote {fmt_ms(remote)}")
        for pair, target, goal, why in (
            ("remote/inproc", 1.05, f"remote / in-process {name} time <= 1.05",
             f"{medians}; the remote step differs by its unary RPCs per step ({rpc_text}) and the "
             "segment-header reads and writes per slice and commit"),
            ("remote/plain", 1.1, f"on CPU, remote / plain fused AdamW {name} time <= 1.1",
             f"{medians}; paired in-process / plain = "
             f"{_x(_med(main['step_paired_ratios']['inproc/plain'][kind]))} (the swap container without any "
             f"server), remote / in-process = {_x(_med(main['step_paired_ratios']['remote/inproc'][kind]))}"),
        ):
            stats = main["step_paired_ratios"][pair][kind]
            reached, ok = verdict(stats, target)
            sweep = ", ".join(_x(_med(s["step_paired_ratios"][pair][kind])) for s in sizes)
            add(goal, f"{_x(_med(stats))} {label} ({ci_text(stats)}; sweep: {sweep})", reached, why, ok)

    ov = main["snapshot_overlap"]
    contention = results["machine"].get("contention") or {}
    opt_ratio = _med(ov["paired_ratio_opt"])
    for kind, name in (("train", "train step"), ("opt", "optimizer step")):
        stats = ov[f"paired_ratio_{kind}"]
        reached, ok = verdict(stats, 1.05)
        why = (
            f"during those snapshots the trainer made {ov['cow_copies']} copy-before-write copies "
            f"({fmt_bytes(ov['cow_copies'] * main['memory']['chunk_bytes'])}) and waited "
            f"{ov['backpressure_waits']} times ({ov['backpressure_wait_s'] * 1e3:.1f} ms) for a copy slot; "
            f"the server used {ov.get('server_cpu_s_per_s', float('nan')):.2f} CPU-s/s persisting, on "
            f"{results['machine']['cpus_usable']} CPUs"
        )
        if contention:
            why += f" that other processes also used at {contention['other_cpu_s_per_s']:.2f} CPU-s/s"
        busy_with, busy_without = ov.get("machine_busy_cpu_s_per_s_with"), ov.get("machine_busy_cpu_s_per_s_without")
        if busy_with is not None:
            why += (f"; the whole machine was busy {busy_with:.2f} CPU-s/s while snapshots persisted and "
                    f"{busy_without:.2f} without (kernel writeback included)")
        if kind == "train" and not math.isnan(opt_ratio):
            why += f"; the optimizer step alone was {_x(opt_ratio)}× (the rest is forward/backward)"
        add(
            f"{name} time with a snapshot persisting / without <= 1.05",
            f"{_x(_med(stats))} {label} ({ci_text(stats)}; {ov['snapshots']} snapshots, {ov['steps_with']} steps "
            "with, each snapshot's steps against the steps right after it)",
            reached, why, ok,
        )

    stalls = [s["stall"]["swap_state"]["stall_s"] for s in sizes]
    worst = max(_med(s) for s in stalls)
    sw = main["stall"]["swap_state"]
    add(
        "trainer-visible snapshot stall <= 5 ms at every size",
        "median " + ", ".join(f"{fmt_ms(_med(s))} ({fmt_count(z['params'])})" for s, z in zip(stalls, sizes)),
        worst <= 5e-3,
        f"snapshot() {label} = metadata JSON built in the trainer ({fmt_ms(_med(sw.get('metadata_s')))}) + the "
        f"Snapshot RPC round trip ({fmt_ms(_med(sw.get('snapshot_rpc_s')))}); an idle CommitStep round trip is "
        f"{fmt_ms(_med(results['control_plane']['commit_s']))}, so the rest is the server's synchronous part of "
        "Snapshot and scheduling on a loaded machine",
    )
    factors = [
        _ratio(_med(s["stall"]["dcp_async_save"]["stall_s"]), _med(s["stall"]["swap_state"]["stall_s"])) for s in sizes
    ]
    async_block = _med(main["stall"]["dcp_async_save"]["stall_s"])
    add(
        "snapshot stall >= 100x below DCP async_save's blocking part",
        ", ".join(f"{_x(f, 0)}x ({fmt_count(z['params'])})" for f, z in zip(factors, sizes)),
        all(f >= 100 for f in factors),
        f"DCP async_save blocked {fmt_ms(async_block)} {label} (it stages a copy, so it grows with the state); "
        f"100x below that is {fmt_ms(async_block / 100)}, under the snapshot() stall measured here "
        f"({fmt_ms(_med(sw['stall_s']))})",
    )

    disk = results["disk"]
    ref = main["stall"]["disk_ref"]
    persist = _med(main["stall"]["swap_state"]["persist_gbps"])
    buffered_write = _med(ref["write_fsync_gbps"])
    direct_write = _med(ref.get("write_direct_gbps"))
    write, how = (direct_write, "O_DIRECT") if not math.isnan(direct_write) else (buffered_write, "buffered")
    frac = _ratio(persist, write)
    crc = _med(results["crc32"]["gbps"])
    memmove = _med(results["memcpy"]["memmove_1thread_gbps"])
    add(
        "persist >= 90% of the disk's O_DIRECT write + fsync of the same bytes",
        f"{persist:.2f} GB/s = {_pct(frac)} of {write:.2f} GB/s {label} ({how} write + fsync of the same "
        f"bytes, right before and right after each snapshot; buffered write + fsync {buffered_write:.2f} GB/s = "
        f"{_pct(_ratio(persist, buffered_write))}; the run's first disk probe gave {_disk_write(disk):.2f} GB/s buffered)",
        frac >= 0.9 if not math.isnan(frac) else None,
        f"one writer thread per rank copies each chunk from shared memory into aligned bounce buffers "
        f"(memmove {memmove:.2f} GB/s), crc32s it there ({crc:.2f} GB/s) and writes them with O_DIRECT, two "
        "in flight; snapshot() → durable also covers the Snapshot RPC, the fsync, the manifest, the atomic "
        "rename and retention",
    )
    restore = main["restore"]
    kept = _med(restore["cold_gbps"])
    direct_read = _med(restore.get("file_direct_read_gbps"))
    cold_read = _med(restore.get("file_cold_read_gbps"))
    read, how = (direct_read, "O_DIRECT") if not math.isnan(direct_read) else (cold_read, "cold buffered")
    new, new_read = _med(restore.get("new_trainer_gbps")), _med(restore.get("new_trainer_file_direct_read_gbps"))
    if math.isnan(new_read):
        new_read = read
    warm = _med(disk.get("read_warm_gbps"))
    frac = _ratio(new, new_read)
    add(
        "restore >= 90% of the disk's O_DIRECT read of the same file",
        f"a new trainer's (cold, its segment fresh) {new:.2f} GB/s = {_pct(frac)} of {new_read:.2f} GB/s {label} "
        f"({how} read of the snapshot's own file right before each restore)",
        frac >= 0.9 if not math.isnan(frac) else None,
        f"the file is read once with O_DIRECT into a small ring of reused buffers, each block crc32-checked "
        f"({crc:.2f} GB/s) and copied into the segment as it comes; a new trainer's segment holds nothing: a "
        "failed check zeroes what was copied",
    )
    kept_frac = _ratio(kept, read)
    add(
        "a running trainer's restore >= 90% of the disk's O_DIRECT read of the same file",
        f"{kept:.2f} GB/s (cold, a committed step kept; from the call to its return, as the trainer waits) = "
        f"{_pct(kept_frac)} of {read:.2f} GB/s {label} ({how} read right before each restore); worst "
        f"{_x(restore['cold_gbps'].get('min', float('nan')), 2)} GB/s; warm {_gb(restore['warm_gbps'])} GB/s vs "
        f"warm buffered read {warm:.2f} GB/s is its CPU part",
        kept_frac >= 0.9 if not math.isnan(kept_frac) else None,
        f"read once as a new trainer's is; a thread first copies each target's kept bytes aside into the "
        f"segment's copy slots (memmove, {memmove:.2f} GB/s: ahead of the disk), and a failed check puts them "
        "all back, so a corrupt snapshot leaves the state as it was",
    )
    if "allocate" in results:
        goals.append(_allocate_goal(results["allocate"]))
    goals.extend(_no_pause_goals(results))
    return goals


def _allocate_goal(alloc: dict[str, Any]) -> dict[str, Any]:
    """A host's ranks allocating together at job start, against one rank and tmpfs's own."""
    g, n = alloc["gib_per_s"], alloc["ranks"]
    together = _ratio(_med(g["ranks_at_once"]), _med(g["one_rank"]))
    raw = _ratio(_med(g["tmpfs_at_once"]), _med(g["tmpfs_one"]))
    return {
        "goal": f"{n} ranks allocating at once >= 80% of one rank's speed",
        "measured": f"{_x(_med(g['ranks_at_once']), 2)} GiB/s together (worst {_x(g['ranks_at_once']['min'], 2)}) vs "
                    f"one rank {_x(_med(g['one_rank']), 2)} GiB/s (worst {_x(g['one_rank']['min'], 2)}) = "
                    f"{_pct(together)}, {fmt_bytes(alloc['bytes'])} in all; tmpfs's own (fallocate, populate, mlock, "
                    f"no server) {_x(_med(g['tmpfs_at_once']), 2)} vs {_x(_med(g['tmpfs_one']), 2)} GiB/s = {_pct(raw)}",
        "reached": (reached := together >= 0.8 if not math.isnan(together) else None),
        "why": "" if reached else "each segment pinned as its pages are faulted (mlock2 MLOCK_ONFAULT; mlock's own walk held the "
               "process's memory map lock for writing, stalling the other ranks' faults), faulted by one pool of "
               "threads for every allocation (as many as the CPUs)",
        "resolved": True,
    }


def _no_pause_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The no-pause goals: isolated, budget >= state; n/a (with the reason) for other runs."""
    main = results["sizes"][-1]
    ov = main["snapshot_overlap"]
    cfg = results.get("config", {})
    state = main["state_bytes"]
    isolated = bool(cfg.get("isolation"))
    big = cfg.get("cow_budget", 0) >= state
    applies = isolated and big
    why_na = ("this run " + " and ".join(x for x, bad in (("was not --isolate", not isolated),
                                                           (f"had --cow-budget {fmt_bytes(cfg.get('cow_budget', 0))} "
                                                            f"< state {fmt_bytes(state)}", not big)) if bad))
    label = f"isolated, {fmt_count(main['params'])} params, budget >= state"
    snapshots = max(1, ov["snapshots"])
    trainer_frac = ov.get("trainer_copied_bytes", 0) / snapshots / state if state else float("nan")
    facts = (f"{ov['snapshots']} snapshots, {ov['steps_with']} steps with; trainer copied "
             f"{fmt_bytes(ov.get('trainer_copied_bytes', 0))} ({ov['cow_copies']} chunks), server staged "
             f"{fmt_bytes(ov.get('server_staged_bytes', 0))}; back-pressure waits {ov['backpressure_waits']} "
             f"({ov['backpressure_wait_s'] * 1e3:.1f} ms); first step after snapshot() "
             f"{fmt_ms(ov['first_step_after_snapshot_opt_s'].get('mean'))} (opt) vs "
             f"{fmt_ms(ov['without_opt_s'].get('mean'))} without; server CPU "
             f"{ov.get('server_cpu_s_per_s', float('nan')):.2f} CPU-s/s while persisting")
    out: list[dict[str, Any]] = []

    def add(goal: str, value: float, measured: str, ok: bool) -> None:
        reached = (None if not applies or math.isnan(value) else ok)
        why = why_na if not applies else facts
        out.append({"goal": f"{goal} ({label})", "measured": measured, "reached": reached, "resolved": True,
                    "why": "" if reached else why})

    r = ov["ratio_opt"]
    add("mean optimizer step while a snapshot persists <= 1.05x without", r["mean"],
        f"{_x(r['mean'])}x (mean {fmt_ms(ov['with_opt_s'].get('mean'))} vs {fmt_ms(ov['without_opt_s'].get('mean'))}; "
        f"p99 {_x(r['p99'])}x)", r["mean"] <= 1.05)
    add("worst optimizer step while a snapshot persists <= 1.25x without", r["max"],
        f"{_x(r['max'])}x (max {fmt_ms(ov['with_opt_s'].get('max'))} vs mean without "
        f"{fmt_ms(ov['without_opt_s'].get('mean'))})", r["max"] <= 1.25)
    add("bytes copied by the trainer <= 5% of the state", trainer_frac,
        f"{_pct(trainer_frac)} of {fmt_bytes(state)} per snapshot", trainer_frac <= 0.05)
    waits = float(ov["backpressure_waits"])
    add("no back-pressure waits", waits, f"{ov['backpressure_waits']} waits", waits == 0)
    return out
