"""Run identity against a real server process: a job id run again (from scratch, or resumed at
another world size) that reaches a step an earlier run snapshotted writes its own bytes, or is
refused; a snapshot reported durable always restores its own run's state."""

from __future__ import annotations

import pytest

from swap_state.client.errors import SnapshotExistsError

from .workload import Workload, build, reference_mismatches, remote, train

pytestmark = pytest.mark.integration


def _run(server, job: str, w: Workload, steps: int, **config):
    """A fresh trainer of ``job`` (a new session) trained ``steps`` steps."""
    model = build(w)
    container = remote(w, model, server.address, job, **config)
    train(model, container, w, range(1, steps + 1))
    return model, container


def _restored(server, job: str, w: Workload, step: int) -> list[str]:
    """The optimizer state of ``job/step-<step>``, restored by a fresh trainer, that differs
    from ``w``'s AdamW at that step (the snapshots hold the moments, not the parameters)."""
    model = build(w)
    container = remote(w, model, server.address, job)
    assert container.restore(f"{job}/step-{step}") == step
    try:
        return [name for name in reference_mismatches(model, container, w, step) if name.count(".") > 1]
    finally:
        container.close()


def test_a_rerun_of_a_job_id_snapshots_its_own_bytes_over_the_first_runs_step(start_server):
    server = start_server()
    first, second = Workload(seed=0), Workload(seed=1)  # other data: other moments
    _, run1 = _run(server, "rerun", first, 3, snapshot_replace_existing=True)
    run1.snapshot().wait_durable(timeout_s=30)
    run1.close()

    _, refused = _run(server, "rerun", second, 3)  # the same step, the same count of commits
    with pytest.raises(SnapshotExistsError, match="earlier attempt"):
        refused.snapshot()
    refused.close()
    assert _restored(server, "rerun", first, 3) == []

    _, run2 = _run(server, "rerun", second, 3, snapshot_replace_existing=True)
    assert run2.snapshot().wait_durable(timeout_s=30).state == "durable"
    run2.close()
    assert _restored(server, "rerun", second, 3) == []  # the second run's bytes, not the first's


def test_a_job_resumed_at_another_world_size_replaces_a_step_its_earlier_size_took(start_server):
    server = start_server()
    w = Workload(seed=2)
    ranks = [_run(server, "resized", w, 4, rank=r, world_size=2, snapshot_replace_existing=True)[1]
             for r in range(2)]
    handles = [container.snapshot() for container in ranks]
    assert [h.wait_durable(timeout_s=30).state for h in handles] == ["durable", "durable"]
    for container in ranks:
        container.close()

    other = Workload(seed=3)
    _, alone = _run(server, "resized", other, 4, snapshot_replace_existing=True)
    status = alone.snapshot().wait_durable(timeout_s=30)  # was INVALID_ARGUMENT: "has world_size 2"
    assert status.state == "durable"
    [listed] = alone.client.list_snapshots("resized").snapshots
    assert (listed.step, listed.world_size, list(listed.ranks)) == (4, 1, [0])
    alone.close()
    assert _restored(server, "resized", other, 4) == []
