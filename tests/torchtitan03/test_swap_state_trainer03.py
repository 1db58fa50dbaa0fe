"""torchtitan 0.3's own trainer with swap-state switched on by the override target
(``--override.imports swap_state.client.torchtitan_override.swap_state``), against the plain
trainer: the same losses bitwise with a host's server and with the embedded default, a
snapshot-mode save at step 3 resumed to 6, a memory-only checkpoint of the replica interval
resumed, a SIGKILL after a checkpoint and a rerun, several
param groups, the settings on torchtitan's CLI where the registry builds the config, two
ranks whose checkpoint resumes on one, FSDP2 x TP2 on four, and a pipeline of two stages on
two ranks whose checkpoint resumes on one.

Servers are real ``swap-state-server`` processes (tests/conftest.py's ``start_server``); the
trainers run in the 0.3 venv (titan03_kit.py).
"""

from __future__ import annotations

import json

import pytest
from test_titan_replicas import hosts  # noqa: F401 (a fixture: servers a and b replicating into each other)
from titan_testkit import LOSS_RANK_ENV, STOP_AFTER_STEP_ENV, STOP_MODE_ENV

from swap_state.client.torchtitan.checkpointing import MEMORY_ONLY_MARKER

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]

TARGET = "swap_state.client.torchtitan_override.swap_state"
N = 3  # the stop; every run is scheduled for 2N steps (its LR schedule follows training.steps)
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.folder", "ckpt", "--checkpoint.interval", str(N),
              "--checkpoint.no-last-save-model-only")  # fmt: skip
GROUPS = ("--module", "group_registry", "--config", "llama3_debugmodel_groups")


def swap_state(**settings) -> tuple[str, ...]:
    """The switch, with the settings as the target's JSON arguments."""
    settings.setdefault("swap_optimizer_times", 3)
    return ("--override.imports", f"{TARGET}={json.dumps(settings)}")


@pytest.fixture(scope="module")
def reference(titan03_runner, tmp_path_factory):
    """Plain torchtitan 0.3, fused AdamW, 2N steps."""
    run = titan03_runner(tmp_path_factory.mktemp("plain03"), steps=2 * N)
    assert run.steps == list(range(1, 2 * N + 1))
    return run


def _tail(run) -> str:
    return run.run.output[-3000:]


@pytest.mark.timeout(300)
def test_the_same_losses_with_a_hosts_server_and_embedded(reference, run_trainer03, start_server, tmp_path):
    server = start_server()
    hosted = run_trainer03(tmp_path / "hosted", *swap_state(swap_state_server=server.address), steps=2 * N)
    assert f"[Override] {TARGET}: optimizer" in hosted.run.output, _tail(hosted)
    assert "SwapStateCheckpointManager.Config" in hosted.run.output, _tail(hosted)
    assert hosted == reference, _tail(hosted) + server.log_text()
    embedded = run_trainer03(tmp_path / "embedded", *swap_state(), steps=2 * N)
    assert "started embedded swap-state-server" in embedded.run.output, _tail(embedded)
    assert embedded == reference, _tail(embedded)


@pytest.mark.timeout(300)
def test_snapshot_mode_saved_at_3_resumes_to_6_bitwise(reference, run_trainer03, tmp_path):
    """The embedded default: its snapshots live in <dump_folder>/swap-state-snapshots, where the
    rerun (another embedded server) finds the one step 3's checkpoint refers to."""
    flags = (*CHECKPOINT, *swap_state(swap_state_checkpoint="snapshot", swap_state_job_id="resume03"))
    first = run_trainer03(tmp_path, *flags, steps=2 * N, env={STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "return"})
    assert first == reference[:N], _tail(first)
    assert any((tmp_path / "swap-state-snapshots").rglob("*.safetensors")), sorted(tmp_path.rglob("*"))[:30]
    step_dir = tmp_path / "ckpt" / f"step-{N}"
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    assert size < 1 << 20, size  # references and small states, not the model and moments
    resumed = run_trainer03(tmp_path, *flags, steps=2 * N)
    assert f"Loading the checkpoint from {step_dir}" in resumed.run.output, _tail(resumed)
    assert resumed.steps == list(range(N + 1, 2 * N + 1))
    assert resumed == reference[N:], _tail(resumed)


@pytest.mark.timeout(300)
def test_a_replica_interval_checkpoint_is_memory_only_and_resumes_bitwise(reference, run_trainer03, hosts, tmp_path):
    """swap_state_replica_interval = 2 beside torchtitan's checkpoints every 3 steps, stopped
    after step 4: the folders are torchtitan's step 3 and step 4, marked memory-only (step 2's
    removed), nothing of step 4 on host a's disk; the rerun resumes from step 4 bitwise."""
    a = hosts["a"]
    flags = (*CHECKPOINT, *swap_state(swap_state_server=a.server.address, swap_state_checkpoint="snapshot",
                                      swap_state_job_id="replica03", swap_state_replica_interval=2))
    first = run_trainer03(tmp_path, *flags, steps=2 * N, env={STOP_AFTER_STEP_ENV: "4", STOP_MODE_ENV: "return"})
    assert first == reference[:4], _tail(first)
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["step-3", "step-4"]
    assert (tmp_path / "ckpt" / "step-4" / MEMORY_ONLY_MARKER).read_text() == "replica03/step-4"
    assert not list(a.snapshots.rglob("step-*4"))
    resumed = run_trainer03(tmp_path, *flags, steps=2 * N)
    assert f"Loading the checkpoint from {tmp_path / 'ckpt' / 'step-4'}" in resumed.run.output, _tail(resumed)
    assert resumed.steps == [5, 6] and resumed == reference[4:], _tail(resumed) + a.server.log_text()


@pytest.mark.timeout(300)
def test_sigkill_after_a_checkpoint_then_rerun(reference, run_trainer03, start_server, tmp_path):
    server = start_server()
    # The server and job id from the environment, as in 0.2.
    host = {"SWAP_STATE_SERVER": server.address, "SWAP_STATE_JOB_ID": "killed03"}
    flags = (*CHECKPOINT, *swap_state(swap_state_checkpoint="snapshot"))
    killed = run_trainer03(tmp_path, *flags, steps=2 * N, env={**host, STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "kill"},
                           expect_returncode=-9)  # fmt: skip
    assert killed.steps == list(range(1, N + 1)) and killed == reference[:N]
    assert "started embedded swap-state-server" not in killed.run.output
    rerun = run_trainer03(tmp_path, *flags, steps=2 * N, env=host)
    assert f"reattached to swap-state at step {N}" in rerun.run.output, _tail(rerun)
    assert f"restored killed03/step-{N}" in rerun.run.output, _tail(rerun)
    assert rerun.steps == list(range(N + 1, 2 * N + 1))
    assert rerun == reference[N:], _tail(rerun) + server.log_text()


@pytest.mark.timeout(300)
def test_several_param_groups_and_the_settings_on_the_cli(run_trainer03, tmp_path):
    """Adam and AdamW groups with their own hyperparameters; the registry builds the swap
    config (with_swap_state), so torchtitan's CLI takes a setting as --optimizer.<name>."""
    plain = run_trainer03(tmp_path / "plain", *GROUPS, steps=2 * N)
    assert "Optimizer Adam (model_part=0)" in plain.run.output, _tail(plain)
    swap = run_trainer03(tmp_path / "swap", "--module", "group_registry", "--config",
                         "llama3_debugmodel_groups_swap_state", "--optimizer.swap-optimizer-times", "2",
                         steps=2 * N)  # fmt: skip
    assert "swap optimizer:" in swap.run.output and "2 slices" in swap.run.output, _tail(swap)
    assert "swap-state optimizer group Adam [norm]" in swap.run.output, _tail(swap)
    assert swap == plain, _tail(swap)


@pytest.mark.timeout(300)
def test_full_checkpoints_load_across_plain_and_swap_state(reference, run_trainer03, start_server, tmp_path):
    """A 'full' checkpoint of swap-state resumes under plain torchtitan, and a plain one under
    swap-state, both bitwise (the optimizer's flat state dict is torchtitan 0.3's form)."""
    server = start_server()
    stop = {STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "return"}
    swap = swap_state(swap_state_server=server.address, swap_state_job_id="full03")
    run_trainer03(tmp_path / "swap-first", *CHECKPOINT, *swap, steps=2 * N, env=stop)
    plain_after = run_trainer03(tmp_path / "swap-first", *CHECKPOINT, steps=2 * N)
    assert plain_after.steps == list(range(N + 1, 2 * N + 1)) and plain_after == reference[N:], _tail(plain_after)
    run_trainer03(tmp_path / "plain-first", *CHECKPOINT, steps=2 * N, env=stop)
    swap_after = run_trainer03(tmp_path / "plain-first", *CHECKPOINT, *swap, steps=2 * N)
    assert swap_after.steps == list(range(N + 1, 2 * N + 1)) and swap_after == reference[N:], _tail(swap_after)


@pytest.mark.timeout(300)
def test_snapshot_retention_follows_keep_latest_k(run_trainer03, start_server, tmp_path):
    """Checkpoints every step, keep_latest_k = 2: the server keeps k + 1 snapshots of the job
    (torchtitan may leave one more checkpoint than k), the newest ones."""
    snapshots = tmp_path / "snapshots"
    server = start_server(snapshot_dir=snapshots)
    run = run_trainer03(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep-latest-k", "2",
                        *swap_state(swap_state_server=server.address, swap_state_checkpoint="snapshot",
                                    swap_state_job_id="kept03"), steps=2 * N)  # fmt: skip
    assert run.steps == list(range(1, 2 * N + 1)), _tail(run)
    kept = sorted(int(p.name.split("-")[1]) for p in (snapshots / "kept03").glob("step-*"))
    assert kept == [2 * N - 2, 2 * N - 1, 2 * N], (kept, server.log_text()[-3000:])


#: Two ranks under torchrun: FSDP over both (0.3's default SPMD backend, spmd_types, wants
#: parameters distributed before FSDP, which plain 0.3.0 does not do on this CPU: the older
#: DTensor path is what runs here, for plain torchtitan and swap-state alike).
TWO_RANKS = ("--parallelism.spmd-backend", "partial_dtensor")
#: 0.3 cannot reshard its dataloader's state: both resumes at one rank start the data afresh.
NO_DATALOADER = ("--checkpoint.exclude-from-loading", "dataloader")


@pytest.mark.timeout(420)
def test_two_ranks_bitwise_then_a_resume_on_one_rank(run_trainer03, start_server, tmp_path):
    """2 ranks train N steps (plain and swap-state, the same losses) and save; each resumes
    on 1 rank to 2N: the server assembles both ranks' shards from its --snapshot-store, and
    the losses equal plain torchtitan's resume of its own checkpoint (resharded by DCP)."""
    server = start_server(shm_size_bytes=512 << 20, snapshot_store=str(tmp_path / "store"))
    swap = swap_state(swap_state_server=server.address, swap_state_checkpoint="snapshot", swap_state_job_id="two03")
    stop = {STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "return"}
    plain_2 = run_trainer03(tmp_path / "plain", *CHECKPOINT, *TWO_RANKS, steps=2 * N, env=stop, nproc=2)
    swap_2 = run_trainer03(tmp_path / "swap", *CHECKPOINT, *swap, *TWO_RANKS, steps=2 * N, env=stop, nproc=2)
    assert swap_2.steps == list(range(1, N + 1)) and swap_2 == plain_2, _tail(swap_2)

    _resumed_on_one_rank_like_plain(run_trainer03, tmp_path, swap, server)



#: FSDP2 x TP2 on 4 ranks: both shard the weights (_StridedShard where they share a dimension).
FSDP_2_TP_2 = ("--parallelism.data-parallel-shard-degree", "2", "--parallelism.tensor-parallel-degree", "2")


@pytest.mark.timeout(600)
def test_fsdp2_times_tp2_on_four_ranks_is_bitwise(run_trainer03, start_server, tmp_path):
    """The same losses as plain torchtitan 0.3 with FSDP2 x TP2 on 4 ranks: TP's gradients
    brought to the parameters' placements, strided shards checked as boxes."""
    server = start_server(shm_size_bytes=512 << 20)
    swap = swap_state(swap_state_server=server.address, swap_state_job_id="fsdp-tp03")
    plain = run_trainer03(tmp_path / "plain", *TWO_RANKS, *FSDP_2_TP_2, steps=N, nproc=4, timeout=420)
    swapped = run_trainer03(tmp_path / "swap", *TWO_RANKS, *FSDP_2_TP_2, *swap, steps=N, nproc=4, timeout=420)
    assert plain.steps == list(range(1, N + 1)), _tail(plain)
    assert swapped == plain, _tail(swapped)


#: A pipeline of 2 stages (1F1B) on 2 ranks, each stage a rank's. 0.3 refuses CUDA graphs with
#: pipeline parallelism (on by default, also on the CPU): "CUDA graphs do not support pipeline
#: parallelism yet". The launcher gives torch 2.13's schedules the pre-split microbatches 0.3
#: passes (launcher.py ``accept_presplit_microbatches``: without it plain 0.3.0 fails with
#: "Expecting 2 arg_mbs but got 1"). The default SPMD backend runs here.
PP_2 = ("--parallelism.pipeline-parallel-degree", "2", "--parallelism.pipeline-parallel-schedule", "1F1B",
        "--training.disable-cuda-graphs")  # fmt: skip


@pytest.mark.timeout(420)
def test_a_pipeline_on_two_ranks_is_bitwise_and_resumes_on_one_rank(run_trainer03, start_server, tmp_path):
    """2 stages on 2 ranks train N steps (plain and swap-state, the same losses, the last
    stage's) and save a snapshot-mode checkpoint; each resumes on 1 rank to 2N: the stages
    held disjoint tensors, the server takes each from the old rank that holds it, and the
    losses equal plain torchtitan's resume of its own checkpoint."""
    server = start_server(shm_size_bytes=512 << 20)
    swap = swap_state(swap_state_server=server.address, swap_state_checkpoint="snapshot", swap_state_job_id="pp03")
    stop = {STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "return", LOSS_RANK_ENV: "1"}  # the loss: last stage's
    plain_2 = run_trainer03(tmp_path / "plain", *CHECKPOINT, *PP_2, steps=2 * N, env=stop, nproc=2)
    swap_2 = run_trainer03(tmp_path / "swap", *CHECKPOINT, *swap, *PP_2, steps=2 * N, env=stop, nproc=2)
    assert plain_2.steps == list(range(1, N + 1)), _tail(plain_2)
    assert "with 2 microbatches and 2 stages" in plain_2.run.output, _tail(plain_2)
    assert swap_2 == plain_2, _tail(swap_2)

    _resumed_on_one_rank_like_plain(run_trainer03, tmp_path, swap, server)


def _resumed_on_one_rank_like_plain(run_trainer03, tmp_path, swap, server) -> None:
    """Plain's 2-rank checkpoint of step N and swap-state's, each resumed on 1 rank to 2N:
    the same losses, swap-state's resharded by its server from the 2 ranks' snapshot."""
    plain_1 = run_trainer03(tmp_path / "plain", *CHECKPOINT, *NO_DATALOADER, steps=2 * N)
    swap_1 = run_trainer03(tmp_path / "swap", *CHECKPOINT, *swap, *NO_DATALOADER, steps=2 * N)
    assert plain_1.steps == list(range(N + 1, 2 * N + 1)), _tail(plain_1)
    assert swap_1.steps == plain_1.steps and swap_1 == plain_1, _tail(swap_1) + server.log_text()[-3000:]
    log = server.log_text()
    assert "restore_assembled" in log and "snapshot_world_size=2" in log, log[-3000:]
