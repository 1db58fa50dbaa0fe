"""The chaos run (``python -m bench.chaos``) in CI: a short window of seeded faults in a row
(two hosts, three jobs), every invariant checked; a longer run's figures are in
docs/reliability.md."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_bench_smoke import REPO  # the repo root


@pytest.mark.timeout(420)
def test_a_short_chaos_run_ends_without_a_violation(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SWAP_STATE_SERVER", "SWAP_STATE_JOB_ID")}
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--minutes", "0.75", "--seed", "7", "--gap-s", "6",
                           "--work-dir", str(tmp_path / "chaos")], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "violations 0" in proc.stdout and "fault:" in proc.stdout, proc.stdout[-2000:]
