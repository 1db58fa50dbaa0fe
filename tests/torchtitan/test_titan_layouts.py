"""torchtitan layouts beyond FSDP, through torchtitan's own trainer on CPU ranks (gloo): the
losses bitwise equal to plain torchtitan's (AdamW, DCP), with a real ``swap-state-server``.

1. Tensor parallel alone (no FSDP) on 2 ranks: gradients come with other placements than their
   parameters (a sharded embedding's Replicate, a norm's Partial), brought to the parameters'
   placements as torch's DTensor dispatch does.
2. A pipeline (2 stages, 1F1B; and 4 stages interleaved on 2 ranks) saves a snapshot-mode
   checkpoint and resumes on 1 rank: the stages hold disjoint tensors; the server takes each
   tensor from the old rank that holds it.
3. FSDP2 x TP2 on 4 ranks resumes on 1 rank under its job id and saves over a step the 4 ranks
   took (the server replaces that snapshot with the new run's); then on 2 ranks with TP2 alone.
4. MoE (llama4's experts, grouped 3-D weights) with FSDP2 x EP2 on 2 ranks, killed with SIGKILL
   after its checkpoint, resumes on 1 rank without expert parallel.
"""

from __future__ import annotations

import pytest

from test_swap_state_trainer import CHECKPOINT, N, SCHEDULE, remote
from test_titan_resume_anywhere import NO_DATALOADER
from snapshot_kit import swap_state_cli
from titan_testkit import LOSS_RANK_ENV, STOP_AFTER_STEP_ENV, STOP_MODE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]

TP_2 = ("--parallelism.tensor_parallel_degree=2",)
PP_2 = ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B")
#: A pipeline's loss is on its last stage.
LAST_STAGE = {LOSS_RANK_ENV: "1"}


@pytest.mark.timeout(300)
def test_tensor_parallel_alone_trains_with_plain_torchtitans_losses(run_trainer, start_server, tmp_path):
    server = start_server()
    plain = run_trainer(tmp_path / "plain", SCHEDULE, *TP_2, steps=N, nproc=2)
    swap = run_trainer(tmp_path / "swap", SCHEDULE, *remote(server, job_id="tp-alone"), *TP_2, steps=N, nproc=2)
    assert plain.steps == list(range(1, N + 1))
    assert swap == plain, f"{swap} != {plain}\n{swap.run.output[-3000:]}"


#: Interleaved 1F1B: two stages per rank (each rank holds layers of both halves of the model).
PP_2_INTERLEAVED = ("--parallelism.pipeline_parallel_degree=2",
                    "--parallelism.pipeline_parallel_schedule=Interleaved1F1B")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("pipeline", [PP_2, PP_2_INTERLEAVED], ids=["1f1b", "interleaved"])
def test_a_pipeline_snapshot_resumes_on_one_rank_with_plain_torchtitans_losses(pipeline, run_trainer, start_server,
                                                                               tmp_path):
    server = start_server(shm_size_bytes=512 << 20)
    swap = remote(server, "snapshot", job_id="titan-pp")
    plain_2 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *pipeline, steps=N, nproc=2, env=LAST_STAGE)
    swap_2 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, *pipeline, steps=N, nproc=2, env=LAST_STAGE)
    assert plain_2.steps == list(range(1, N + 1))
    assert swap_2 == plain_2, f"{swap_2} != {plain_2}\n{swap_2.run.output[-3000:]}"

    plain_1 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, NO_DATALOADER, steps=2 * N)
    swap_1 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, NO_DATALOADER, steps=2 * N)
    assert plain_1.steps == list(range(N + 1, 2 * N + 1)), plain_1.run.output[-3000:]
    assert swap_1 == plain_1, f"{swap_1} != {plain_1}\n{swap_1.run.output[-3000:]}\n{server.log_text()[-3000:]}"
    assert "restore_assembled" in server.log_text()


#: FSDP over 2 ranks times TP over 2: _StridedShard placements where both shard a dimension.
FSDP_2_TP_2 = ("--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2")


@pytest.mark.timeout(840)
def test_a_2x2_job_resumed_on_one_rank_under_its_job_id_saves_over_a_step_it_took(
        run_trainer, start_server, tmp_path):
    """4 ranks (FSDP2 x TP2) save snapshot-mode checkpoints at steps 3 and 6; the job resumes
    from step 3 on 1 rank under the same job id and saves step 6 again: the server replaces the
    4-rank snapshot of step 6 with the 1-rank run's, and the losses are plain torchtitan's
    resuming its own DCP checkpoint the same way. Then the same 4-rank checkpoint of step 3
    resumes once more, on 2 ranks with TP2 alone (no FSDP: each rank's shard is a whole TP
    shard, assembled from two FSDP shards of the old ranks), and saves step 6 a third time."""
    server = start_server(shm_size_bytes=512 << 20)
    swap = remote(server, "snapshot", job_id="titan-2x2")
    plain_4 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *FSDP_2_TP_2, steps=2 * N, nproc=4, timeout=420)
    swap_4 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, *FSDP_2_TP_2, steps=2 * N, nproc=4,
                         timeout=420)
    assert plain_4.steps == list(range(1, 2 * N + 1))
    assert swap_4 == plain_4, f"{swap_4} != {plain_4}\n{swap_4.run.output[-3000:]}"

    from_3 = (*CHECKPOINT, f"--checkpoint.load_step={N}", NO_DATALOADER)
    plain_1 = run_trainer(tmp_path / "plain", SCHEDULE, *from_3, steps=2 * N)
    swap_1 = run_trainer(tmp_path / "swap", SCHEDULE, *from_3, *swap, steps=2 * N)
    assert plain_1.steps == list(range(N + 1, 2 * N + 1)), plain_1.run.output[-3000:]
    assert swap_1 == plain_1, f"{swap_1} != {plain_1}\n{swap_1.run.output[-3000:]}\n{server.log_text()[-3000:]}"
    listed = swap_state_cli("snapshots", "--server", server.address, "--job-id", "titan-2x2")
    assert f"titan-2x2/step-{2 * N}\t1 ranks" in listed.stdout, listed.stdout  # the 4 ranks' replaced

    # 2x2 -> TP only: step 3's checkpoint is still the 4 ranks' (the 1-rank run saved step 6 only).
    plain_tp = run_trainer(tmp_path / "plain", SCHEDULE, *from_3, *TP_2, steps=2 * N, nproc=2)
    swap_tp = run_trainer(tmp_path / "swap", SCHEDULE, *from_3, *swap, *TP_2, steps=2 * N, nproc=2)
    assert plain_tp.steps == list(range(N + 1, 2 * N + 1)), plain_tp.run.output[-3000:]
    assert swap_tp == plain_tp, f"{swap_tp} != {plain_tp}\n{swap_tp.run.output[-3000:]}\n{server.log_text()[-3000:]}"
    assembled = [line for line in server.log_text().splitlines() if "restore_assembled" in line]
    assert any(" world_size=2 " in f"{line} " and "snapshot_world_size=4" in line for line in assembled), assembled
    listed = swap_state_cli("snapshots", "--server", server.address, "--job-id", "titan-2x2")
    assert f"titan-2x2/step-{2 * N}\t2 ranks" in listed.stdout, listed.stdout  # the 1 rank's replaced


#: llama4's debug model: MoE layers whose experts are grouped 3-D weights (the launcher counts
#: tokens and permutes them as the CPU can: ``cpu_shims.moe_on_cpu``).
MOE = ("--model.name=llama4", "--model.flavor=debugmodel")
FSDP_2_EP_2 = ("--parallelism.data_parallel_shard_degree=2", "--parallelism.expert_parallel_degree=2")


@pytest.mark.timeout(600)
def test_moe_with_expert_parallel_killed_resumes_on_one_rank_with_plain_torchtitans_losses(
        run_trainer, start_server, tmp_path):
    """2 ranks (FSDP2 x EP2: each rank holds half the experts) save a snapshot-mode checkpoint
    at step 3 and are killed with SIGKILL right after it; the job resumes on 1 rank without
    expert parallel (every expert on the one rank): the server assembles each expert tensor
    from the two old ranks' halves, and the losses are plain torchtitan's."""
    server = start_server(shm_size_bytes=512 << 20)
    swap = remote(server, "snapshot", job_id="titan-moe-ep")
    plain_2 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *MOE, *FSDP_2_EP_2, steps=N, nproc=2)
    killed = {STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "kill"}
    swap_2 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, *MOE, *FSDP_2_EP_2, steps=2 * N,
                         nproc=2, env=killed, check=False)
    assert plain_2.steps == list(range(1, N + 1))
    assert swap_2.run.returncode != 0, swap_2.run.output[-3000:]  # killed, not finished
    assert swap_2 == plain_2, f"{swap_2} != {plain_2}\n{swap_2.run.output[-3000:]}"

    plain_1 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *MOE, NO_DATALOADER, steps=2 * N)
    swap_1 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, *MOE, NO_DATALOADER, steps=2 * N)
    assert plain_1.steps == list(range(N + 1, 2 * N + 1)), plain_1.run.output[-3000:]
    assert swap_1 == plain_1, f"{swap_1} != {plain_1}\n{swap_1.run.output[-3000:]}\n{server.log_text()[-3000:]}"
    assert "restore_assembled" in server.log_text()  # resharded from the 2 ranks' halves
