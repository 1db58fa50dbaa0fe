"""The Prometheus endpoint of a real server process says what snapshots did."""

from __future__ import annotations

import socket
import time
import urllib.request

from .workload import Workload, build, remote, train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_metrics_count_steps_and_snapshots(start_server):
    port = _free_port()
    server = start_server(metrics_port=f"127.0.0.1:{port}")
    w = Workload()
    model = build(w)
    container = remote(w, model, server.address, "metrics")
    train(model, container, w, range(1, 4))
    container.snapshot().wait_durable(timeout_s=30)
    deadline = time.monotonic() + 10
    while True:  # the server counts a rank once its writer has finished (after durable)
        metrics = _scrape(port)
        if metrics.get("swap_state_snapshots_durable_total") == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metrics["swap_state_snapshots_durable_total"] == 1
    assert metrics["swap_state_snapshots_started_total"] == 1
    assert metrics["swap_state_snapshot_bytes_total"] > 0
    assert "swap_state_snapshot_backpressure_waits_total" in metrics
    assert metrics["swap_state_steps_committed_total"] == 3
    # The trainer committed those steps through its header words: no CommitStep RPC per step.
    assert not [name for name, value in metrics.items() if 'method="CommitStep"' in name and value]
    container.close()
