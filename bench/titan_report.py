"""The report of ``python -m bench.titan_checkpoint``: per size, each mode's
``CheckpointManager.save`` blocking times and folder sizes against the goals, as markdown.
Nothing here asserts a threshold."""

from __future__ import annotations

import math
from typing import Any

from bench.goals import _ratio, _x
from bench.util import fmt_bytes, fmt_ms

__all__ = ["CHECKPOINT_MODES", "evaluate_goals", "markdown", "summarize_size"]

CHECKPOINT_MODES = ("sync", "async", "snapshot")
"""The modes that save checkpoints (the others are step-time baselines)."""


def _med(stats: dict[str, Any] | None) -> float:
    return stats.get("median", float("nan")) if stats and stats.get("n") else float("nan")


def _mmm(stats: dict[str, Any]) -> str:
    if not stats or not stats.get("n"):
        return "n/a"
    return f"{fmt_ms(stats['median'])} / {fmt_ms(stats['mean'])} / {fmt_ms(stats['max'])}"


def _mean_max(stats: dict[str, Any]) -> str:
    if not stats or not stats.get("n"):
        return "n/a"
    return f"{fmt_ms(stats['mean'])} / {fmt_ms(stats['max'])} (n={stats['n']})"


def _snapshot_counts_line(run: dict[str, Any]) -> str:
    """Per save of a snapshot-mode run: what the persisting snapshot cost the trainer's steps."""
    saves = run["saves"]

    def each(key: str, fmt) -> str:
        return ", ".join(fmt(x[key]) if x.get(key) is not None else "?" for x in saves)

    line = (f"Snapshot mode, per save: back-pressure waits {each('backpressure_waits', str)} "
            f"({each('backpressure_wait_seconds', lambda v: f'{v:.2f} s')}), trainer copies "
            f"{each('trainer_copied_bytes', fmt_bytes)}, server staged {each('server_staged_bytes', fmt_bytes)}.")
    budget = run.get("copy_budget") or {}
    if budget.get("copy_slot_bytes") is not None:
        line += (f" Copy slots {fmt_bytes(budget['copy_slot_bytes'])}, needed "
                 f"{fmt_bytes(budget.get('copy_budget_needed_bytes', 0))}")
        line += f" (server: \"{budget['copy_budget_warning']}\")." if budget.get("copy_budget_warning") else "."
    return line


def _each_ms(saves: list[dict[str, Any]]) -> str:
    return ", ".join(f"{1e3 * s['blocking_s']:.0f}" for s in saves) + " ms" if saves else "n/a"


def summarize_size(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_mode = {r["mode"]: r for r in runs if not r.get("error")}
    state = next((r["state"] for r in runs if r.get("state")), {})
    whole = state.get("param_bytes", 0) + state.get("moment_bytes", 0)
    med = {m: _med(by_mode[m]["blocking_s"]) if m in by_mode else float("nan") for m in CHECKPOINT_MODES}
    mx = {m: by_mode[m]["blocking_s"].get("max", float("nan")) if m in by_mode else float("nan")
          for m in CHECKPOINT_MODES}
    return {
        "params": state.get("params"),
        "param_bytes": state.get("param_bytes"),
        "moment_bytes": state.get("moment_bytes"),
        "whole_state_bytes": whole,
        "blocking_median_s": med,
        "blocking_max_s": mx,
        "ratio_snapshot_sync": _ratio(med["snapshot"], med["sync"]),
        "ratio_snapshot_async": _ratio(med["snapshot"], med["async"]),
        "ratio_snapshot_sync_max": _ratio(mx["snapshot"], mx["sync"]),
        "ratio_snapshot_async_max": _ratio(mx["snapshot"], mx["async"]),
    }


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    for group in results["sizes"]:
        s = group["summary"]
        name = group["size"] + (" (pinned)" if group.get("pinned") else "")
        r_sync, r_async = s["ratio_snapshot_sync"], s["ratio_snapshot_async"]
        goals.append({
            "goal": f"{name}: snapshot-mode save blocks <= 1/4 of plain synchronous (median)",
            "measured": f"{_x(r_sync)} (snapshot {fmt_ms(s['blocking_median_s']['snapshot'])}, sync "
                        f"{fmt_ms(s['blocking_median_s']['sync'])}; max/max {_x(s['ratio_snapshot_sync_max'])})",
            "reached": None if math.isnan(r_sync) else r_sync <= 0.25,
        })
        goals.append({
            "goal": f"{name}: snapshot-mode save blocks less than plain async (median)",
            "measured": f"{_x(r_async)} (snapshot {fmt_ms(s['blocking_median_s']['snapshot'])}, async "
                        f"{fmt_ms(s['blocking_median_s']['async'])}; max/max {_x(s['ratio_snapshot_async_max'])})",
            "reached": None if math.isnan(r_async) else r_async < 1.0,
        })
        snap = next((r for r in group["runs"] if r["mode"] == "snapshot" and not r.get("error")), None)
        if snap is not None:
            steps = snap["folders"]["checkpoint_steps"]
            tensor = [st["tensor_bytes"] for st in steps]
            biggest = max((st["bytes"] for st in steps), default=0)
            no_tensors = bool(steps) and all(t == 0 for t in tensor)
            reached = no_tensors and (biggest < (1 << 20) if group["size"] == "debugmodel" else True)
            goals.append({
                "goal": f"{name}: snapshot-mode checkpoint folder holds no tensor bytes"
                        + (" (< 1 MiB per step folder)" if group["size"] == "debugmodel" else ""),
                "measured": f"tensor bytes per step folder {tensor}; largest step folder {fmt_bytes(biggest)}",
                "reached": reached,
            })  # fmt: skip
    return goals


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# torchtitan CheckpointManager.save: trainer-visible stall",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cpus_usable')} usable CPUs (nproc), "
        f"{fmt_bytes(m.get('ram_bytes', 0))} RAM; torch {m.get('torch')}, torchtitan {m.get('torchtitan')}; "
        f"disk write+fsync {_x(results.get('disk', {}).get('write_fsync_gbps'), 2)} GB/s "
        f"({results.get('disk', {}).get('probe_bytes', 0) >> 20} MiB probe).",
        "",
        f"Command: `{results['config']['command']}`; runtime {results['runtime_s']:.0f} s.",
        "",
        "Blocking = wall time of the training loop's `checkpointer.save(step)` call on a saving step;",
        "done = until its background work (DCP's write, the server's snapshot) finished;",
        "steps 1-2 are warm-up and left out of the step times. All times: median / mean / max.",
        "",
        "## Stall against the whole state (params + AdamW moments, fp32)",
        "",
        "| size | params | whole state | sync | async | snapshot | snapshot/sync | snapshot/async |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in results["sizes"]:
        s = g["summary"]
        b = s["blocking_median_s"]
        name = g["size"] + (" (pinned)" if g.get("pinned") else "")
        lines.append(f"| {name} | {s['params'] or 'n/a'} | {fmt_bytes(s['whole_state_bytes'] or 0)} | "
                     f"{fmt_ms(b['sync'])} | {fmt_ms(b['async'])} | {fmt_ms(b['snapshot'])} | "
                     f"{_x(s['ratio_snapshot_sync'])} | {_x(s['ratio_snapshot_async'])} |")
    for g in results["sizes"]:
        s = g["summary"]
        name = g["size"] + (" (pinned: trainer CPU 0, server CPU 1)" if g.get("pinned") else "")
        lines += [
            "",
            f"## {name}: {s['params']} params, whole state {fmt_bytes(s['whole_state_bytes'] or 0)} "
            f"(params {fmt_bytes(s['param_bytes'] or 0)} + moments {fmt_bytes(s['moment_bytes'] or 0)})",
            "",
            "| mode | saves | blocking med / mean / max | each save (blocking) | done med / mean / max | "
            "waited for previous | checkpoint step folder | its tensor bytes | server snapshot per step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in g["runs"]:
            if r["mode"] not in CHECKPOINT_MODES:  # the modes that save
                continue
            if r.get("error"):
                lines.append(f"| {r['mode']} | failed: {r['error']} ||||||||")
                continue
            f = r["folders"]
            tensors = sorted({st["tensor_bytes"] for st in f["checkpoint_steps"]}, key=lambda v: (v is None, v))
            snap = f.get("snapshot_step_bytes")
            lines.append(
                f"| {r['mode']} | {r['blocking_s'].get('n', 0)} | {_mmm(r['blocking_s'])} | "
                f"{_each_ms(r['saves'])} | {_mmm(r['done_s'])} | "
                f"{r['saves_waiting_for_previous']} | {fmt_bytes(_med(f['checkpoint_step_bytes']))} | "
                f"{', '.join(fmt_bytes(t) if t is not None else '?' for t in tensors) or 'n/a'} | "
                f"{fmt_bytes(_med(snap)) if snap and snap.get('n') else '-'} |"
            )
        for r in g["runs"]:
            if r["mode"] == "snapshot" and not r.get("error") and r["saves"]:
                lines += ["", _snapshot_counts_line(r)]
        lines += [
            "",
            f"Ratios (median): snapshot/sync {_x(s['ratio_snapshot_sync'])}, snapshot/async "
            f"{_x(s['ratio_snapshot_async'])}; (max): snapshot/sync {_x(s['ratio_snapshot_sync_max'])}, "
            f"snapshot/async {_x(s['ratio_snapshot_async_max'])}.",
            "",
            "Step time, mean / max (n): quiet = no save and no background work; after save = the",
            "step right after a saving step; background = other steps overlapping a save's background work.",
            "",
            "| mode | quiet steps | step after a save | during background | all steady (median) | "
            "run wall | other load (CPU s/s) | trainer peak RSS |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in g["runs"]:
            if r.get("error"):
                continue
            st = r["step_s"]
            lines.append(
                f"| {r['mode']} | {_mean_max(st['quiet'])} | {_mean_max(st['after_save'])} | "
                f"{_mean_max(st['background'])} | {fmt_ms(_med(st['all']))} | {r['wall_s']:.0f} s | "
                f"{_x(r.get('other_cpu_s_per_s'), 2)} | {fmt_bytes(r.get('peak_rss_bytes') or 0)} |"
            )
    lines += ["", "## Against the issue's goals (reported, not asserted)", ""]
    for goal in results["goals"]:
        mark = {True: "REACHED", False: "SHORT", None: "n/a"}[goal["reached"]]
        lines.append(f"- [{mark}] {goal['goal']}: {goal['measured']}")
    lines += ["", "## Commands (one per run)", ""]
    for g in results["sizes"]:
        for r in g["runs"]:
            lines.append(f"- {r['size']}/{r['mode']}{'/pinned' if r['pinned'] else ''}: `{r['command']}`")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- entry
