"""Smoke test of the replica-transport benchmark (``python -m bench.transport``) at a tiny size,
Mooncake skipped: every transport moves the bytes from one process to another and they arrive
intact (the sender's crc32 of its source, the receiver's of what it holds, and this test's of
the bytes the benchmark generated agree). No timing is asserted: numbers at this size mean
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_bench_smoke import REPO  # the repo root

pytestmark = pytest.mark.integration

ROWS = ("memcpy", "raw-tcp", "framed-tcp-crc", "framed-tcp", "grpc-crc", "grpc")


@pytest.mark.timeout(150)
def test_transport_bench_moves_the_bytes_intact(tmp_path):
    pin = ["--pin", "both"] if len(os.sched_getaffinity(0)) >= 2 else []
    proc = subprocess.run(
        [sys.executable, "-m", "bench.transport", "--sizes", "4M", "--chunk", "1M", "--reps", "1", "--no-mooncake",
         *pin, "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "transport.json").read_text())
    assert result["runs"] and not result["failures"]
    for run in result["runs"]:
        assert run["size"] == 4 << 20
        rows = run["rows"]
        for key in ROWS:
            row = rows[key]
            # one transfer; the bytes as generated == the sender's source == the receiver's buffer
            assert row["gbps"]["n"] == 1 and row["intact"], (key, row)
            assert row["source_crc"] == run["expected_crc"], key
            assert row["received_crcs"] == [run["expected_crc"]], key
        assert rows["mooncake"]["skipped"] == "--no-mooncake"
    md = (tmp_path / "transport.md").read_text()
    assert "raw TCP (the baseline)" in md and "Mooncake skipped: --no-mooncake" in md
