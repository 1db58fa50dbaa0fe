"""Many ranks of one job on one real server process: ranks waiting for their group hold no
server thread, so the server answers every RPC however many wait (a thread per waiting rank
stopped a server whose waiting ranks outnumbered its executor: min(32, CPUs + 4) threads)."""

from __future__ import annotations

import pytest

from swap_state.client.remote.rpc import ClientConfig, SwapStateClient

from .workload import Workload, build, train, remote

pytestmark = pytest.mark.integration

RANKS = 16


def test_sixteen_ranks_arriving_apart_all_become_durable_and_the_server_answers_meanwhile(start_server):
    server = start_server()
    work = [Workload(seed=rank) for rank in range(RANKS)]
    models = [build(w) for w in work]
    ranks = [remote(w, model, server.address, "sixteen", rank=rank, world_size=RANKS, rpc_timeout_s=10.0)
             for rank, (w, model) in enumerate(zip(work, models))]
    observer = SwapStateClient(ClientConfig(server.address, rpc_timeout_s=5.0))
    try:
        for rank, container in enumerate(ranks):
            train(models[rank], container, work[rank], range(1, 3))
        handles = []
        for rank, container in enumerate(ranks):  # one after another: the first ones wait for the rest
            handles.append(container.snapshot())
            if rank == RANKS - 1:
                break  # the group is whole: it may be durable already
            assert observer.list_snapshots("sixteen").snapshots == []  # not durable before rank 15
            persisting = [s for s in observer.stats().snapshots_in_progress if s.snapshot_id == "sixteen/step-2"]
            assert sorted(s.rank for s in persisting) == list(range(rank + 1))
        statuses = [handle.wait_durable(timeout_s=60) for handle in handles]
        assert {status.state for status in statuses} == {"durable"}
        [listed] = observer.list_snapshots("sixteen").snapshots
        assert (listed.step, listed.world_size, list(listed.ranks)) == (2, RANKS, list(range(RANKS)))
    finally:
        observer.close()
        for container in ranks:
            container.close()
