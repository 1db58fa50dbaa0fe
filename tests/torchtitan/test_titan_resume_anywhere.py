"""torchtitan's own trainer resumes a snapshot-mode checkpoint at another world size.

2 ranks (torchrun, gloo, FSDP2 over both) train N steps and save a snapshot-mode checkpoint
(whole-state snapshots: the server holds each rank's shards of the parameters and moments);
plain torchtitan (AdamW, DCP) does the same beside it. Then each resumes on 1 rank (no FSDP
there: plain tensors) and trains to 2N: swap-state's server assembles the whole tensors from
the two ranks' shards, and the losses equal plain torchtitan's resuming its own DCP checkpoint
(resharded by DCP), bit for bit. The server is a real ``swap-state-server`` process with a ``--snapshot-store``.
"""

from __future__ import annotations

import pytest

from test_swap_state_trainer import CHECKPOINT, N, SCHEDULE, remote

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]

#: torchtitan 0.2 cannot reshard its dataloader's state ("dataloader resharding is not supported
#: yet"): both resumes start the data afresh, the same way.
NO_DATALOADER = "--checkpoint.exclude_from_loading=dataloader"
#: FSDP over the 2 ranks: parameters and moments are DTensor shards of dim 0.
FSDP_2 = ("--parallelism.data_parallel_shard_degree=2",)


@pytest.mark.timeout(420)
def test_a_two_rank_snapshot_checkpoint_resumes_on_one_rank_with_plain_torchtitans_losses(
    run_trainer, start_server, tmp_path
):
    server = start_server(shm_size_bytes=512 << 20, snapshot_store=str(tmp_path / "store"))
    swap = (*remote(server, "snapshot", job_id="titan-anywhere"),)
    plain_2 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *FSDP_2, steps=N, nproc=2)
    swap_2 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, *FSDP_2, steps=N, nproc=2)
    assert swap_2.steps == list(range(1, N + 1)) and swap_2 == plain_2

    plain_1 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, NO_DATALOADER, steps=2 * N)
    swap_1 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, NO_DATALOADER, steps=2 * N)
    assert plain_1.steps == list(range(N + 1, 2 * N + 1)), plain_1.run.output[-3000:]
    assert swap_1.steps == plain_1.steps, swap_1.run.output[-3000:]
    assert swap_1 == plain_1, f"{swap_1} != {plain_1}\n{server.log_text()[-3000:]}"
    log = server.log_text()
    assert "restore_assembled" in log and "snapshot_world_size=2" in log and "world_size=1" in log, log[-3000:]
