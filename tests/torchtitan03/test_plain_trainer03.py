"""The 0.3 harness itself: torchtitan 0.3's own Trainer on the CPU, no swap-state.

Every run is a subprocess of tests/torchtitan03/launcher.py (the 0.3 venv's python) on the tiny
llama3 debugmodel job of titan03_kit.base_flags03; losses are compared as float.hex()
strings, i.e. bitwise. These are the guarantees the swap-state 0.3 tests build on.
"""

from __future__ import annotations

import math

import pytest
from titan_testkit import STOP_AFTER_STEP_ENV, STOP_MODE_ENV

# A run takes ~10 s here (2 cores); each is given RUN_TIMEOUT and a test runs at most three.
pytestmark = pytest.mark.timeout(420)
RUN_TIMEOUT = 120.0

STEPS = 6
SAVE_AT = 3
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.folder", "ckpt", "--checkpoint.interval", str(SAVE_AT))
CPU_ATTENTION_LOG = "[Override] cpu_overrides.cpu_sdpa_attention"


@pytest.fixture(scope="module")
def straight(titan03_runner, tmp_path_factory):
    """The reference: the plain job, STEPS steps, no checkpoints."""
    return titan03_runner(tmp_path_factory.mktemp("straight03"), steps=STEPS, timeout=RUN_TIMEOUT)


def test_plain_runs_are_bitwise_deterministic(straight, run_trainer03, tmp_path):
    assert straight.steps == list(range(1, STEPS + 1))
    values = [float.fromhex(h) for h in straight]
    assert all(math.isfinite(v) for v in values), values
    # Something is learned (the text is a sparse Markov chain), so equal runs mean something.
    assert len(set(straight)) == STEPS and values[-1] < values[0], values
    assert "Training completed" in straight.run.output
    assert CPU_ATTENTION_LOG in straight.run.output
    assert "activation checkpointing to the model" not in straight.run.output  # the kit's none
    again = run_trainer03(tmp_path, steps=STEPS, timeout=RUN_TIMEOUT)
    assert again == straight


def test_dcp_save_at_step_3_resumes_bitwise(straight, run_trainer03, tmp_path):
    """The STEPS-step job stops after step 3 (return mode) once step 3 is saved; rerun, resume."""
    stop = {STOP_AFTER_STEP_ENV: str(SAVE_AT), STOP_MODE_ENV: "return"}
    first = run_trainer03(tmp_path, *CHECKPOINT, steps=STEPS, env=stop, timeout=RUN_TIMEOUT)
    assert first.steps == list(range(1, SAVE_AT + 1))
    assert (tmp_path / "ckpt" / f"step-{SAVE_AT}").is_dir()
    resumed = run_trainer03(tmp_path, *CHECKPOINT, steps=STEPS, timeout=RUN_TIMEOUT)
    assert f"Loading the checkpoint from {tmp_path / 'ckpt' / f'step-{SAVE_AT}'}" in resumed.run.output
    assert resumed.steps == list(range(SAVE_AT + 1, STEPS + 1))
    assert first == straight[:SAVE_AT]
    assert resumed == straight[SAVE_AT:]


def test_sigkill_stop_keeps_the_steps_before(straight, run_trainer03, tmp_path):
    """SIGKILL after step 2: no exit code, no close, the loss file has steps 1-2. The same run
    also passes a caller override with kwargs (an identity), which applies beside the
    launcher's CPU attention override without changing a bit."""
    kill = {STOP_AFTER_STEP_ENV: "2", STOP_MODE_ENV: "kill"}
    probe = 'probe_overrides.identity_probe={"tag": "sigkill"}'
    killed = run_trainer03(tmp_path, "--override.imports", probe, steps=STEPS, env=kill,
                           expect_returncode=-9, timeout=RUN_TIMEOUT)
    assert killed.steps == [1, 2]
    assert killed == straight[:2]
    assert "Training completed" not in killed.run.output
    assert "[Override] probe_overrides.identity_probe: optimizer" in killed.run.output
    assert "with tag='sigkill'" in killed.run.output
    assert CPU_ATTENTION_LOG in killed.run.output
