"""A real trainer in snapshot mode: the server counts its model tensors as the session's model
area, and ``swap-state status`` shows it."""

from __future__ import annotations

import pytest

from snapshot_kit import swap_state_cli
from .workload import Workload, build, remote, train

pytestmark = pytest.mark.integration

W = Workload()


def test_status_shows_the_model_area_of_a_whole_state_session(start_server):
    server = start_server()
    model = build(W)
    container = remote(W, model, server.address, "area", checkpoint="snapshot")
    train(model, container, W, range(1, 2))

    session = container.client.stats().sessions[0]
    assert session.model_bytes == sum(v.nbytes for v in model.state_dict().values())
    assert 0 < session.model_bytes < session.segment_bytes

    shown = swap_state_cli("status", "--server", server.address)
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if "area/rank 0/1 " in line)
    assert f"(model {session.model_bytes / (1 << 30):.3f} GiB) last step 1" in line
    container.close()
