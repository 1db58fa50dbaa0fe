"""Smoke tests of the one-question benchmarks (``python -m bench.restart``, ``bench.quiet_steps``,
``bench.allocate``, ``bench.scale``) end to end at a small size: the reports are written with every row and
numbers. No threshold is asserted: numbers at this size on a CI machine mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_bench_smoke import REPO  # the repo root

pytestmark = pytest.mark.integration


def _run(module: str, *args: str, out, stem: str) -> tuple[dict, str]:
    """Run the benchmark; its ``<stem>.json`` (parsed) and ``<stem>.md``."""
    env = {k: v for k, v in os.environ.items() if k not in ("SWAP_STATE_SERVER", "SWAP_STATE_JOB_ID")}
    proc = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / f"{stem}.json").read_text()), (out / f"{stem}.md").read_text()


@pytest.mark.timeout(180)
def test_quiet_steps_bench_at_a_small_size(tmp_path):
    result, md = _run("bench.quiet_steps", "--params", "1M", "--rounds", "3", "--block", "1", out=tmp_path,
                      stem="quiet-steps")
    for name in ("moments_only", "whole_state", "whole_state_copy_every_step"):
        assert result["summary"][name]["n"] == 3 and result["summary"][name]["median"] > 0, name
    assert "median ÷ moments-only" in md


@pytest.mark.timeout(180)
def test_allocate_bench_at_a_small_size(tmp_path):
    result, md = _run("bench.allocate", "--size", "64M", "--ranks", "2", "--reps", "1", out=tmp_path,
                      stem="allocate")
    for key in ("one_rank", "ranks_at_once", "tmpfs_one", "tmpfs_at_once"):
        assert result["gib_per_s"][key]["n"] == 1 and result["gib_per_s"][key]["median"] > 0, key
    assert "2 ranks at once ÷ one rank" in md


@pytest.mark.timeout(180)
def test_restart_bench_at_a_small_size(tmp_path):
    result, md = _run("bench.restart", "--params", "1M", "--steps", "4", "--reps", "2", out=tmp_path,
                      stem="restart")
    for key in ("step_up_s", "step_gone_s", "fresh_start_s", "adopt_after_kill_s", "stop_and_adopt_s", "reconnect_s"):
        assert result["summary"][key]["n"] >= 2 and result["summary"][key]["median"] > 0, key
    assert result["reconnects_total_last_server"] == 1  # the last server saw the trainer come back
    assert "Step time with the server gone / up" in md and "Adoption adds" in md


@pytest.mark.timeout(180)
def test_many_tensors_bench_at_a_small_size(tmp_path):
    result, md = _run("bench.many_tensors", "--counts", "20,60", "--shape", "8x5", "--steps", "3",
                      "--snapshots", "3", out=tmp_path, stem="many-tensors")
    assert [row["count"] for row in result["rows"]] == [20, 60]
    for row in result["rows"]:
        assert row["bitwise_equal"]
        assert row["summary"]["remote"]["n"] == 3 and row["summary"]["snapshot"]["n"] == 2
    assert "first snapshot() (sends the base)" in md


def test_check_cost_prints_attach_and_snapshot_latency(capsys):
    from bench.check_cost import main

    assert main(["--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "Attach   (2): median" in out and "Snapshot (2): median" in out and "worst" in out


@pytest.mark.timeout(180)
def test_scale_bench_at_a_small_size(tmp_path):
    result, md = _run("bench.scale", "--ranks", "8", "--repeat", "1", "--store-ranks", "16",
                      "--layouts", "70b-fsdp,405b-tp8", out=tmp_path, stem="scale")
    plans, manifest, [store] = result["plans"], result["manifest"], result["store"]
    assert [(case["layout"], case["old_ranks"], case["new_ranks"]) for case in plans] == \
        [("70b-fsdp", 8, 6), ("70b-fsdp", 8, 10), ("405b-tp8", 8, 8)]  # TP8 keeps whole TP groups
    assert [case["tensors_per_rank"] for case in plans] == [1446, 1446, 3411]  # 405B: moments and a step each
    assert all(case["plan_cpu_s"]["median"] > 0 and case["baseline_plan_cpu_s"]["median"] > 0 for case in plans)
    assert all(0 < case["layout_bytes"] < 1 << 20 and case["manifests_read"] >= 1 for case in plans)
    assert all(case["bytes_read"] >= case["bytes_needed"] > 0 for case in plans)
    assert manifest["tensors"] == 3411 and 0 < manifest["compact_bytes"] < manifest["version_1_bytes"]
    assert store["ranks"] == 16 and 0 < store["upload_per_rank"] <= 10 and store["latest_requests"] <= 20
    assert "8 -> 6" in md and "one rank's manifest at 8 ranks" in md and "store requests at 16 ranks" in md
