"""torchtitan's own Trainer (train.py's main, CheckpointManager, ConfigManager) on the CPU.

Every run is a subprocess of tests/torchtitan/launcher.py on the tiny llama3 debugmodel job
of titan_testkit.base_flags; losses are compared as float.hex() strings, i.e. bitwise.
"""

from __future__ import annotations

import math

import pytest

from titan_testkit import STOP_AFTER_STEP_ENV, STOP_EXIT_CODE_ENV, STOP_MODE_ENV

pytestmark = pytest.mark.timeout(300)

N = 4  # steps before the stop; the full run is 2N
# One lr schedule for every run, whatever its --training.steps: the 2N-step one.
SCHEDULE = f"--lr_scheduler.total_steps={2 * N}"
CHECKPOINT = (
    "--checkpoint.enable",
    "--checkpoint.folder=ckpt",
    f"--checkpoint.interval={N}",
    # A run that ends at step N saves step N in full (optimizer, dataloader, train state),
    # not torchtitan's default model-only last-step export, so that it can be resumed.
    "--checkpoint.no-last_save_model_only",
)


@pytest.fixture(scope="module")
def uninterrupted(titan_assets, tmp_path_factory):
    """Plain AdamW (fused) for 2N steps, no checkpoints: the reference run."""
    from titan_testkit import launch

    return launch(titan_assets, tmp_path_factory.mktemp("uninterrupted"), SCHEDULE, steps=2 * N)


def test_adamw_runs_and_is_deterministic(uninterrupted, run_trainer, tmp_path):
    assert uninterrupted.steps == list(range(1, 2 * N + 1))
    values = [float.fromhex(h) for h in uninterrupted.losses]
    assert all(math.isfinite(v) for v in values), values
    assert "Training completed" in uninterrupted.output
    # It learns something: the generated text is a sparse Markov chain.
    assert values[-1] < values[0], values
    again = run_trainer(tmp_path / "again", SCHEDULE, steps=2 * N)
    assert again == uninterrupted.losses


def test_checkpoint_stop_and_extend_resumes_bitwise(uninterrupted, run_trainer, tmp_path):
    """Run to step N (checkpoint at N), then rerun the same folder with --training.steps 2N."""
    first = run_trainer(tmp_path, *CHECKPOINT, SCHEDULE, steps=N)
    assert first.steps == list(range(1, N + 1))
    assert (tmp_path / "ckpt" / f"step-{N}").is_dir()
    resumed = run_trainer(tmp_path, *CHECKPOINT, SCHEDULE, steps=2 * N)
    assert f"Loading the checkpoint from {tmp_path / 'ckpt' / f'step-{N}'}" in resumed.run.output
    assert resumed.steps == list(range(N + 1, 2 * N + 1))
    assert first == uninterrupted.losses[:N]
    assert resumed == uninterrupted.losses[N:]


def test_checkpoint_crash_and_restart_resumes_bitwise(uninterrupted, run_trainer, tmp_path):
    """The 2N-step job dies (os._exit) right after step N's checkpoint; the same job reruns."""
    crash = {STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "exit", STOP_EXIT_CODE_ENV: "43"}
    first = run_trainer(tmp_path, *CHECKPOINT, SCHEDULE, steps=2 * N, env=crash,
                        expect_returncode=43)
    assert first.steps == list(range(1, N + 1))
    assert "Training completed" not in first.run.output
    resumed = run_trainer(tmp_path, *CHECKPOINT, SCHEDULE, steps=2 * N)
    assert resumed.steps == list(range(N + 1, 2 * N + 1))
    assert first == uninterrupted.losses[:N]
    assert resumed == uninterrupted.losses[N:]


def test_swap_state_config_module_loads(uninterrupted, run_trainer, tmp_path):
    """--job.custom_config_module adds the [optimizer] swap fields; with swap off the
    trainer builds torch's own AdamW and the losses are the reference's."""
    losses = run_trainer(
        tmp_path,
        "--job.custom_config_module=swap_state.client.torchtitan_config",
        "--optimizer.no-swap_optimizer",
        "--optimizer.swap_optimizer_times=3",
        "--optimizer.swap_optimizer_backend=local",
        "--optimizer.swap_state_checkpoint=full",
        SCHEDULE,
        steps=2,
    )
    assert losses == uninterrupted.losses[:2]
