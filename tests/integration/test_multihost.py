"""One host of a two-host job: ONE real server process with two trainer ranks (2 and 3 of
world_size 4, local_world_size 2) in this process. The other host's ranks (0, 1) never reach
this server, yet its snapshot becomes durable with ranks [2, 3], restores for both, and
training continues bitwise as if uninterrupted."""

from __future__ import annotations

import json
import pathlib

import grpc
import pytest

from swap_state.client.remote.rpc import ClientConfig, SwapStateClient, SwapStateError

from snapshot_kit import params_copy, reference, swap_state_cli
from .workload import Workload, build, mismatches, remote, train

pytestmark = pytest.mark.integration

WORLD = 4
RANKS = (2, 3)
#: Different data per rank, so a mixed-up rank file would not go unnoticed.
WORK = {rank: Workload(seed=rank) for rank in RANKS}


def test_one_hosts_ranks_make_a_durable_snapshot_that_restores_bitwise(start_server, monkeypatch):
    server = start_server()
    models = {rank: build(WORK[rank]) for rank in RANKS}
    containers = {
        2: remote(WORK[2], models[2], server.address, "mh", rank=2, world_size=WORLD, local_world_size=2),
    }
    # Rank 3 gets it the way torchrun tells it: $LOCAL_WORLD_SIZE.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    containers[3] = remote(WORK[3], models[3], server.address, "mh", rank=3, world_size=WORLD)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    try:
        assert [c.session.local_world_size for c in containers.values()] == [2, 2]
        for rank in RANKS:
            train(models[rank], containers[rank], WORK[rank], range(1, 6))
        params_at_5 = {rank: params_copy(models[rank]) for rank in RANKS}
        handles = {rank: containers[rank].snapshot() for rank in RANKS}
        statuses = {rank: handles[rank].wait_durable(timeout_s=30) for rank in RANKS}
        assert {s.path for s in statuses.values()} == {statuses[2].path}

        client = SwapStateClient(ClientConfig(server.address))
        try:
            [info] = client.list_snapshots("mh").snapshots
        finally:
            client.close()
        assert (info.snapshot_id, info.world_size, list(info.ranks), info.local_world_size, info.latest) == (
            "mh/step-5", WORLD, list(RANKS), 2, True,
        )
        index = json.loads((pathlib.Path(info.path) / "snapshot.json").read_text())
        assert (index["world_size"], index["ranks"], index["local_world_size"]) == (WORLD, [2, 3], 2)
        listed = swap_state_cli("snapshots", "--server", server.address, "--job-id", "mh")
        assert listed.returncode == 0 and f"ranks 2,3 of {WORLD}" in listed.stdout, listed

        for rank in RANKS:
            train(models[rank], containers[rank], WORK[rank], range(6, 9))
        for rank in RANKS:
            assert containers[rank].restore("latest") == 5
            models[rank].load_state_dict(params_at_5[rank])
            train(models[rank], containers[rank], WORK[rank], range(6, 11))
            ref_model, ref_opt = reference(WORK[rank], build, 10)
            assert mismatches(models[rank], containers[rank], ref_model, ref_opt) == [], rank
    finally:
        for container in containers.values():
            container.close()


def test_restore_of_another_hosts_rank_and_a_bad_local_world_size_are_refused(start_server):
    server = start_server()
    w = Workload()
    models = {rank: build(w) for rank in (0, 2, 3)}
    containers = {
        rank: remote(w, models[rank], server.address, "mh2", rank=rank, world_size=WORLD, local_world_size=2)
        for rank in RANKS
    }
    try:
        for rank in RANKS:
            train(models[rank], containers[rank], w, range(1, 3))
        handles = [containers[rank].snapshot() for rank in RANKS]
        for handle in handles:
            handle.wait_durable(timeout_s=30)
        # Rank 0 lives on the other host; attached here by mistake, its restore says where to look.
        stray = remote(w, models[0], server.address, "mh2", rank=0, world_size=WORLD, local_world_size=2)
        try:
            with pytest.raises(SwapStateError) as caught:
                stray.restore("latest")
        finally:
            stray.close()
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
        assert "holds ranks [2, 3] of world_size 4, not rank 0" in str(caught.value)
        assert "another host's server" in str(caught.value)
    finally:
        for container in containers.values():
            container.close()

    with pytest.raises(SwapStateError) as caught:
        remote(w, build(w), server.address, "mh3", rank=2, world_size=WORLD, local_world_size=5)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "local_world_size 5 must be in [1, world_size 4]" in str(caught.value)
