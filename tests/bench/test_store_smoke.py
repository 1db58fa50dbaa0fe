"""Smoke test of the store benchmark: ``python -m bench.store`` end to end at a small size,
both stores (a directory, and S3 through a moto server process the bench starts), checking
that store.md and store.json hold the four sections with numbers. No threshold is asserted:
numbers at this size on a CI machine mean nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from test_bench_smoke import ISOLATE, REPO  # the repo root; --isolate where 2 CPUs

pytestmark = pytest.mark.integration

SECTIONS = (
    "## 1. Upload throughput",
    "## 2. Restore-from-store throughput",
    "## 3. Step time while uploading",
    "## 4. Host-loss recovery time",
)
NUMBER = re.compile(r"\d+\.\d+")


def _section(md: str, heading: str) -> str:
    start = md.index(heading)
    following = [md.index(h) for h in SECTIONS if md.index(h) > start]
    return md[start : min(following, default=len(md))]


@pytest.mark.timeout(180)
def test_store_bench_runs_end_to_end_at_a_small_size(tmp_path):
    pytest.importorskip("moto")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("SWAP_STATE_SERVER", "SWAP_STATE_JOB_ID")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.store", "--params", "1M", "--steps", "4", "--store", "both", *ISOLATE,
         "--out", str(out)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    md = (out / "store.md").read_text()
    for heading in SECTIONS:
        table = [line for line in _section(md, heading).splitlines() if line.startswith("| ")][1:]  # no header
        assert {row.split("|")[1].strip() for row in table} == {"path", "s3"}, (heading, table)
        for row in table:
            assert "n/a" not in row and len(NUMBER.findall(row)) >= 3, (heading, row)

    results = json.loads((out / "store.json").read_text())
    for kind in ("path", "s3"):
        store = results["stores"][kind]
        assert store["upload"]["server_gbps"]["n"] == 3 and store["upload"]["ratio"]["median"] > 0
        assert store["restore"]["restore_gbps"]["n"] == 3 and store["restore"]["baseline_gbps"]["median"] > 0
        shared = store["steps"]["shared"]
        assert shared["uploading_opt_s"]["n"] >= 1 and shared["idle_opt_s"]["n"] >= 1
        assert {"median", "mean", "p99", "max"} <= set(shared["uploading_opt_s"])
        assert set(store["steps"]) == ({"shared", "isolated"} if ISOLATE else {"shared"})
        assert store["host_loss"]["total_s"]["n"] == 3
    assert not list(out.glob(".bench-store-work-*"))  # scratch removed
