"""A job's ranks on one server snapshot a step together (a group): what each rank sees when the
group fails, whatever the timing, and when a server restart splits it (issue 48, items 3-4).
Real server processes; two ranks in this process, as two trainers of a host."""

from __future__ import annotations

import subprocess
import time

import pytest

from swap_state.client.errors import SnapshotFailedError
from swap_state.client.remote.rpc import SnapshotHandle
from snapshot_kit import CHUNK, build_wide, moment_bytes, params_copy, reference, tiny_tmpfs

from .workload import Workload, build, mismatches, remote, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

W = Workload()


def _two_ranks(server, job: str, builder=build) -> list:
    """Ranks 0 and 1 of ``job`` (world size 2, both on ``server``), each its own model."""
    models = [builder(W) for _ in range(2)]
    containers = [remote(W, model, server.address, job, rank=rank, world_size=2, local_world_size=2,
                         rpc_timeout_s=5.0, server_wait_s=30.0) for rank, model in enumerate(models)]
    return list(zip(models, containers))


def _durable_and_plain_adamw(ranks: list, builder, step: int) -> None:
    """Each rank's snapshot of ``step`` (its last committed) durable, and its state plain AdamW's there, bitwise."""
    handles = [container.snapshot() for _, container in ranks]
    assert [h.wait_durable(timeout_s=60).state for h in handles] == ["durable"] * len(ranks)
    ref_model, ref_opt = reference(W, builder, step)
    for model, container in ranks:
        assert mismatches(model, container, ref_model, ref_opt) == []


def test_a_rank_coming_after_its_group_failed_gets_a_failed_handle_not_a_raise(start_server, tmp_path):
    """The disk fills under rank 0's part of step 3; rank 1 asks for step 3 a second later: a
    handle, failed, like rank 0's (it used to raise, for that rank only). Once the disk has room
    again both ranks' next snapshot is durable, and rank 0's end-of-run wait returns."""
    with tiny_tmpfs(tmp_path / "small", "128k") as small:
        server = start_server(chunk_bytes=CHUNK, snapshot_dir=str(small))
        ranks = _two_ranks(server, "full", build_wide)
        assert moment_bytes(ranks[0][0]) > 4 * (128 << 10)
        try:
            for model, container in ranks:
                train(model, container, W, range(1, 4))
            (_, first), (_, second) = ranks
            early = first.snapshot()  # consistent; the disk is found full while writing
            with pytest.raises(SnapshotFailedError, match="is full"):
                early.wait_durable(timeout_s=60)
            late = second.snapshot()  # the group failed before this rank came: no raise
            assert late.snapshot_id == early.snapshot_id == "full/step-3"
            with pytest.raises(SnapshotFailedError, match="is full"):
                late.wait_durable(timeout_s=10)
            remount = subprocess.run(["mount", "-o", "remount,size=64m", str(small)], capture_output=True, text=True)
            assert remount.returncode == 0, remount.stderr
            for model, container in ranks:
                train(model, container, W, range(4, 5))
            _durable_and_plain_adamw(ranks, build_wide, 4)
        finally:
            for _, container in ranks:
                container.close()
            server.stop()


def test_a_group_split_by_a_restart_fails_within_seconds_on_the_successor(start_server):
    """Rank 0's Snapshot of step 3 reached the old server (stopped: it failed there); rank 1's
    reaches the successor, whose group then waits for a rank 0 that has moved on to step 4. It
    fails as soon as rank 0's commit of step 4 shows, not at the 300 s assembly deadline, and
    the ranks' next snapshot is durable."""
    server = start_server(free_segments_on_stop=False, grace=300.0)
    ranks = _two_ranks(server, "split")
    try:
        for model, container in ranks:
            train(model, container, W, range(1, 4))
        (model0, first), (model1, second) = ranks
        first.snapshot()  # the old server's group: rank 0 only
        server.restart()  # SIGTERM fails it; the successor adopts both segments
        late = second.snapshot()  # rides through to the successor: a new group, waiting for rank 0
        train(model0, first, W, range(4, 5))  # rank 0 moves on: its commit of step 4 is the evidence
        with pytest.raises(SnapshotFailedError, match="rank 0 of job split committed step 4 without snapshotting step 3"):
            late.wait_durable(timeout_s=60)  # failed within it, not at the 300 s deadline (the message names why)
        train(model1, second, W, range(4, 5))
        handles = [container.snapshot() for _, container in ranks]
        assert [h.wait_durable(timeout_s=60).state for h in handles] == ["durable", "durable"]
    finally:
        for _, container in ranks:
            container.close()


def test_a_job_restarted_mid_group_restores_within_seconds_and_resumes_bitwise(start_server):
    """Both trainers are killed after rank 0 asked for the snapshot of step 3 and before rank 1
    did (chaos found it). The restarted ranks' restore of ``latest`` waited for that snapshot,
    which could never complete (the new rank 1 retrains), up to the 300 s assembly deadline.
    Now rank 1's new Attach fails it: the restore takes seconds, and the job resumes bitwise."""
    server = start_server()
    ranks = _two_ranks(server, "restarted")
    for model, container in ranks:
        train(model, container, W, range(1, 3))
    handles = [container.snapshot() for _, container in ranks]
    assert [h.wait_durable(timeout_s=60).state for h in handles] == ["durable", "durable"]
    at_2 = [params_copy(model) for model, _ in ranks]
    for model, container in ranks:
        train(model, container, W, range(3, 4))
    pending = ranks[0][1].snapshot()  # rank 1's trainer dies before it asks for step 3
    for _, container in ranks:
        container.close(keep=True)  # what a killed trainer leaves: its session and segment, for --grace
    ranks = _two_ranks(server, "restarted")
    try:
        assert [c.resumed_step for _, c in ranks] == [3, 3]
        began = time.monotonic()
        assert [c.restore("latest") for _, c in ranks] == [2, 2]
        assert time.monotonic() - began < 120  # not the 300 s deadline (the status names the restart)
        status = SnapshotHandle(pending.snapshot_id, 3, 0, ranks[0][1].client).status()
        assert status.state == "failed" and "rank 1 of job restarted restarted" in status.error
        for (model, container), params in zip(ranks, at_2):
            model.load_state_dict(params)
            train(model, container, W, range(3, 5))
        _durable_and_plain_adamw(ranks, build, 4)
    finally:
        for _, container in ranks:
            container.close()
