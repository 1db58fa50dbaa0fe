"""Smoke test of the restart benchmark: ``python -m bench.restart`` end to end at a small size,
checking that restart.md and restart.json hold every row with numbers and that the trainer
reconnected after each restart. No threshold is asserted: numbers at this size on a CI machine
mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_bench_smoke import REPO  # the repo root

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_restart_bench_runs_end_to_end_at_a_small_size(tmp_path):
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("SWAP_STATE_SERVER", "SWAP_STATE_JOB_ID")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.restart", "--params", "1M", "--steps", "4", "--reps", "2", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "restart.json").read_text())
    for key in ("step_up_s", "step_gone_s", "fresh_start_s", "adopt_after_kill_s", "stop_and_adopt_s", "reconnect_s"):
        assert result["summary"][key]["n"] >= 2 and result["summary"][key]["median"] > 0, key
    assert result["reconnects_total_last_server"] == 1  # the last server saw the trainer come back
    md = (out / "restart.md").read_text()
    assert "Step time with the server gone / up" in md and "Adoption adds" in md
