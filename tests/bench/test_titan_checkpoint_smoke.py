"""Smoke test of ``python -m bench.titan_checkpoint``: torchtitan's own trainer on the CPU, the
llama3 debugmodel, two interval saves per mode (plain synchronous, plain async, swap-state
whole-state snapshot mode with its embedded server).

Checks only that the report is written and holds numbers for all three modes; no speed is
asserted (the suite measures, it does not judge).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan (the client extra) is not installed")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
MODES = ("sync", "async", "snapshot")

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]


@pytest.mark.timeout(120)
def test_titan_checkpoint_report_has_every_mode(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.titan_checkpoint", "--sizes", "debugmodel", "--modes", ",".join(MODES),
         "--saves", "2", "--interval", "2", "--disk-probe", "0", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((out / "titan-checkpoint.json").read_text())
    (size,) = results["sizes"]
    assert size["size"] == "debugmodel"
    runs = {r["mode"]: r for r in size["runs"]}
    assert set(runs) == set(MODES)
    for mode, run in runs.items():
        assert run["error"] is None, (mode, run.get("log_tail"))
        assert run["blocking_s"]["n"] == 2, (mode, run["saves"])
        for key in ("median", "mean", "max"):
            assert math.isfinite(run["blocking_s"][key]) and run["blocking_s"][key] > 0, (mode, key)
        assert run["step_s"]["all"]["n"] > 0
        assert run["folders"]["checkpoint_steps"], mode
    summary = size["summary"]
    assert summary["whole_state_bytes"] > 0
    for key in ("ratio_snapshot_sync", "ratio_snapshot_async"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    assert all(m in summary["blocking_median_s"] for m in MODES)
    assert results["goals"] and all("reached" in g for g in results["goals"])

    md = (out / "titan-checkpoint.md").read_text()
    assert "## debugmodel" in md and "Against the issue's goals" in md
    for mode in MODES:
        assert f"| {mode} |" in md
    assert not list(out.glob(".titan-work-*"))  # scratch (dump folders, assets) removed
