"""A real swap-state-server stages a snapshot ahead of the trainer: with copy slots for the
whole state the trainer copies nothing and never waits, the snapshot holds step N bitwise,
restores bitwise, and ``swap-state status`` shows the copy budget (and says when it is short)."""

from __future__ import annotations

import time

import pytest
from safetensors.torch import load_file

from snapshot_kit import (
    CHUNK,
    bitwise_diff,
    build_wide,
    data_file,
    moment_bytes,
    params_copy,
    record_state,
    reference,
    swap_state_cli,
)
from swap_state.common.segment import Word

from .workload import Workload, mismatches, remote, train

pytestmark = pytest.mark.integration

W = Workload()


def test_server_stages_ahead_so_the_trainer_copies_nothing(start_server):
    server = start_server(
        chunk_bytes=CHUNK, persist_max_bandwidth="256K", cow_budget="2M"
    )
    model = build_wide(W)
    container = remote(W, model, server.address, "nopause")
    train(model, container, W, range(1, 4))
    at_3 = record_state(model, container)
    params_at_3 = params_copy(model)
    handle = container.snapshot()
    # A forward/backward's worth of time: the server stages the state meanwhile (waited for,
    # bounded, rather than slept: a loaded CI machine may take longer than a real step).
    header, n_chunks = container.segment.mapping.header, len(container.segment.mapping.chunks)
    deadline = time.monotonic() + 10
    while header[Word.STAGED_UPTO] < n_chunks and header[Word.PERSISTED_UPTO] < n_chunks:
        assert time.monotonic() < deadline, "the server never staged the state"
        time.sleep(0.01)
    # The capped writer needs about 2 s for the state: the next steps start while it persists
    # (checked before them, not after: how long they take on a loaded machine is no matter).
    assert handle.status().state == "persisting"
    train(model, container, W, range(4, 7))

    status = handle.wait_durable(timeout_s=60)
    assert bitwise_diff(at_3, load_file(str(data_file(status.path)))) == []
    assert status.cow_copies == 0 and status.trainer_copied_bytes == 0
    assert status.backpressure_waits == 0
    assert status.server_staged_chunks > 0
    assert status.server_staged_bytes >= status.bytes_total - moment_bytes(model) // 2

    assert container.restore("latest") == 3
    model.load_state_dict(params_at_3)
    train(model, container, W, range(4, 9))
    ref_model, ref_opt = reference(W, build_wide, 8)
    assert mismatches(model, container, ref_model, ref_opt) == []

    shown = swap_state_cli("status", "--server", server.address)
    assert shown.returncode == 0, shown.stderr
    assert "staging thread" in shown.stdout and "copy slots" in shown.stdout
    assert "WARNING" not in shown.stdout
    container.close()


def test_status_warns_when_the_copy_budget_is_short(start_server):
    server = start_server(
        chunk_bytes=CHUNK, persist_max_bandwidth="512K", cow_budget="128K"
    )
    model = build_wide(W)
    container = remote(W, model, server.address, "short")
    train(model, container, W, range(1, 2))
    shown = swap_state_cli("status", "--server", server.address)
    assert shown.returncode == 0, shown.stderr
    assert "SHORT" in shown.stdout
    assert "WARNING short/rank 0: copy budget short by" in shown.stdout
    assert "raise --cow-budget" in shown.stdout
    container.close()
