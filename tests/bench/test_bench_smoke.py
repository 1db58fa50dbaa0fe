"""Smoke test of the benchmark suite: ``python -m bench`` end to end at a tiny size.

Runs every section (step time, snapshot overlap, checkpoint stalls, persist/restore, control
plane, memory; CUDA only with a GPU) against a real embedded server, and checks that the
outputs exist and hold every section. No threshold is asserted: numbers at this size on a
CI machine mean nothing, and the suite measures, it does not judge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

# --isolate pins the server and the trainer apart; it needs two usable CPUs.
ISOLATE = ["--isolate"] if len(os.sched_getaffinity(0)) >= 2 else []

TINY = [
    "--params", "64K", "--sweep", "16K",
    "--steps", "2", "--warmup", "1", "--block", "1",
    "--snapshot-steps", "2", "--snapshot-seconds", "10",
    "--ckpt-reps", "1", "--restore-reps", "1", "--disk-reps", "1",
    "--commit-samples", "20", "--cuda-params", "64K",
]  # fmt: skip


@pytest.mark.timeout(90)
def test_bench_runs_end_to_end_at_a_tiny_size(tmp_path):
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("SWAP_STATE_SERVER", "SWAP_STATE_JOB_ID")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *TINY, *ISOLATE, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((out / "bench.json").read_text())
    assert [s["requested_params"] for s in results["sizes"]] == [16 << 10, 64 << 10]
    for size in results["sizes"]:
        assert set(size["step"]) == {"plain", "inproc", "remote"}
        assert size["step"]["remote"]["train"]["n"] == 2
        assert size["snapshot_overlap"]["snapshots"] >= 1
        assert set(size["stall"]) >= {"torch_save", "dcp_save", "dcp_async_save", "swap_state"}
        assert size["restore"]["cold_s"]["n"] == 1
        assert sum(size["rpc"]["per_step"].values()) <= 1.0  # no RPC per step (at most CommitStep)
        overlap = size["snapshot_overlap"]
        for key in ("with_opt_s", "without_opt_s", "with_train_s", "without_train_s"):
            assert {"mean", "p99", "max"} <= set(overlap[key])
        assert {"mean", "p99", "max"} <= set(overlap["ratio_opt"])
        assert overlap["trainer_copied_bytes"] >= 0 and overlap["server_staged_bytes"] >= 0
        assert "unary_rpcs_per_step" in overlap
        assert size["restore"]["file_cold_read_gbps"]["n"] == 1
        assert size["memory"]["server"].get("RssShmem", 0) > 0
    assert results["control_plane"]["commit_s"]["n"] == 20
    assert {"write_fsync_gbps", "read_cold_gbps"} <= set(results["disk"])
    assert results["goals"] and all("reached" in g for g in results["goals"])
    assert "skipped" in results["cuda"] or "copy" in results["cuda"]
    if ISOLATE:
        isolation = results["config"]["isolation"]
        assert isolation["server_cpus"] and isolation["trainer_cpus"]
        assert not set(isolation["server_cpus"]) & set(isolation["trainer_cpus"])
        assert isolation["torch_threads"] == len(isolation["trainer_cpus"])
    assert any("budget >= state" in g["goal"] for g in results["goals"])

    md = (out / "bench.md").read_text()
    for heading in ("## Step time", "## Checkpoint", "## Throughput", "## Control plane", "## Memory",
                    "## Sweep", "## CUDA", "## Against the issue's goals"):
        assert heading in md
    assert (out / "bench.png").exists() or "bench.png skipped:" in proc.stdout
    assert not list(out.glob(".bench-work-*"))  # scratch (checkpoints, snapshots, probe) removed
