"""swap-state under torchtitan's own Trainer on the CPU: the same numbers as torch's AdamW.

Every run is a subprocess of tests/torchtitan/launcher.py on the tiny llama3 debugmodel job of
titan_testkit.base_flags; per-step losses are compared as float.hex() strings (bitwise) against
one uninterrupted plain AdamW (fused) run of 2N steps. Every run shares that run's lr schedule
(``--lr_scheduler.total_steps=2N``) whatever its ``--training.steps``.

1. plain AdamW == swap-state remote (a real server process) == the embedded default (no
   server configured) == the local backend, for 2N steps;
2. stop at N (checkpoint) and rerun to 2N, "full" and "snapshot";
3. the 2N-step job dies (os._exit, or SIGKILL in snapshot mode: the snapshot the checkpoint
   refers to completes on the server without the trainer) right after step N's checkpoint and
   reruns with the same job id: it reattaches to the kept segment but must use the checkpoint, "full" and "snapshot";
4. "snapshot": the server is restarted (same --snapshot-dir) between the stop and the rerun;
5. a rerun with the same job id and no checkpoint (the kept segment of a finished run) trains
   fresh and says that it drops the kept state;
6. training again from an older checkpoint with a fixed job id overwrites the checkpoints of
   those steps, and their snapshots with them;
7. ``swap-state export --format torchtitan`` turns a snapshot-mode checkpoint into a plain one
   that torchtitan without swap-state resumes from bitwise; a corrupt snapshot fails naming
   the file and tensor and leaves no output.

The servers are real ``swap-state-server`` processes (tests/conftest.py's ``start_server``,
segments in a private directory of /dev/shm), stopped at the end of each test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from swap_state.client.optim.checkpoint_template import MODEL_REF_KEY, checkpoint_keys
from swap_state.client.remote.embedded import EmbeddedServer
from snapshot_kit import flip_byte_of_tensor, swap_state_cli
from titan_testkit import STOP_AFTER_STEP_ENV, STOP_EXIT_CODE_ENV, STOP_MODE_ENV, launch

# Nothing inherited: a run names its server and job id, or gets the embedded default.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]

N = 3  # steps before the stop; the full run is 2N
SCHEDULE = f"--lr_scheduler.total_steps={2 * N}"
CHECKPOINT = (
    "--checkpoint.enable",
    "--checkpoint.folder=ckpt",
    f"--checkpoint.interval={N}",
    "--checkpoint.no-last_save_model_only",
)
SWAP = (
    "--job.custom_config_module=swap_state.client.torchtitan_config",
    "--optimizer.swap_optimizer",
    "--optimizer.swap_optimizer_times=3",
)
CRASH = {STOP_AFTER_STEP_ENV: str(N), STOP_MODE_ENV: "exit", STOP_EXIT_CODE_ENV: "43"}
DROP_WARNING = "dropping the swap-state optimizer state kept for job"


def remote(server: EmbeddedServer | None, mode: str = "full", job_id: str | None = None) -> tuple[str, ...]:
    flags = (*SWAP, "--optimizer.swap_optimizer_backend=remote", f"--optimizer.swap_state_checkpoint={mode}")
    if server is not None:
        flags += (f"--optimizer.swap_state_server={server.address}",)
    if job_id is not None:
        flags += (f"--optimizer.swap_state_job_id={job_id}",)
    return flags


@pytest.fixture(scope="module")
def reference(titan_assets, tmp_path_factory):
    """Plain AdamW (fused) for 2N steps, no checkpoints."""
    run = launch(titan_assets, tmp_path_factory.mktemp("reference"), SCHEDULE, steps=2 * N)
    assert run.steps == list(range(1, 2 * N + 1))
    return run.losses


def _server_log(server: EmbeddedServer) -> str:
    return f"\n--- server log ---\n{server.log_text()}"


@pytest.mark.timeout(240)
def test_the_same_losses_with_every_backend(reference, run_trainer, start_server, tmp_path):
    server = start_server()
    with_server = run_trainer(tmp_path / "remote", *remote(server), SCHEDULE, steps=2 * N)
    assert with_server == reference, with_server.run.output[-3000:] + _server_log(server)
    embedded = run_trainer(tmp_path / "embedded", *remote(None), SCHEDULE, steps=2 * N)
    assert "started embedded swap-state-server" in embedded.run.output
    assert embedded == reference
    local = run_trainer(
        tmp_path / "local", *SWAP, "--optimizer.swap_optimizer_backend=local", SCHEDULE, steps=2 * N
    )
    assert local == reference


def _loaded(output: str, dump: Path, step: int = N) -> bool:
    return f"Loading the checkpoint from {dump / 'ckpt' / f'step-{step}'}" in output


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["full", "snapshot"])
def test_stop_and_resume(mode, reference, run_trainer, start_server, tmp_path):
    server = start_server()
    first = run_trainer(tmp_path, *CHECKPOINT, *remote(server, mode), SCHEDULE, steps=N)
    assert first == reference[:N]
    step_dir = tmp_path / "ckpt" / f"step-{N}"
    assert step_dir.is_dir()
    keys = checkpoint_keys(step_dir)
    if mode == "snapshot":
        # The whole state is in the snapshot: the checkpoint holds references and small states.
        assert MODEL_REF_KEY in keys and "tok_embeddings.weight" not in keys, sorted(keys)[:20]
        size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
        assert size < 1 << 20, size
    else:
        assert "tok_embeddings.weight" in keys and MODEL_REF_KEY not in keys
    resumed = run_trainer(tmp_path, *CHECKPOINT, *remote(server, mode), SCHEDULE, steps=2 * N)
    assert _loaded(resumed.run.output, tmp_path), resumed.run.output[-3000:]
    if mode == "snapshot":
        assert f"/step-{N} (step {N})" in resumed.run.output, resumed.run.output[-3000:]
    assert resumed.steps == list(range(N + 1, 2 * N + 1))
    assert resumed == reference[N:], resumed.run.output[-3000:] + _server_log(server)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,how", [("full", "exit"), ("snapshot", "exit"), ("snapshot", "kill")])
def test_killed_after_a_checkpoint_and_rerun(mode, how, reference, run_trainer, start_server, tmp_path):
    server = start_server()
    flags = (*CHECKPOINT, *remote(server, mode, job_id=f"killed-{mode}"), SCHEDULE)
    crash = {**CRASH, STOP_MODE_ENV: how}
    first = run_trainer(tmp_path, *flags, steps=2 * N, env=crash, expect_returncode=43 if how == "exit" else -9)
    assert first.steps == list(range(1, N + 1))
    assert "Training completed" not in first.run.output
    assert first == reference[:N]
    rerun = run_trainer(tmp_path, *flags, steps=2 * N)
    assert _loaded(rerun.run.output, tmp_path), rerun.run.output[-3000:]
    # It found the dead trainer's kept segment, and the checkpoint's load replaced it.
    assert f"reattached to swap-state at step {N}" in rerun.run.output, rerun.run.output[-3000:]
    assert DROP_WARNING not in rerun.run.output
    if mode == "snapshot":
        assert f"restored killed-{mode}/step-{N}" in rerun.run.output, rerun.run.output[-3000:]
    assert rerun.steps == list(range(N + 1, 2 * N + 1))
    assert rerun == reference[N:], rerun.run.output[-3000:] + _server_log(server)


@pytest.mark.timeout(240)
def test_snapshot_resume_after_a_server_restart(reference, run_trainer, start_server, tmp_path):
    snapshots = tmp_path / "server-snapshots"
    server_a = start_server(snapshot_dir=snapshots)
    first = run_trainer(tmp_path / "job", *CHECKPOINT, *remote(server_a, "snapshot"), SCHEDULE, steps=N)
    assert first == reference[:N]
    server_a.stop()  # SIGTERM: its socket and segments go; its snapshots stay
    assert any(p.name.startswith("step-") for p in snapshots.glob("*/*")), sorted(snapshots.rglob("*"))
    server_b = start_server(snapshot_dir=snapshots)
    resumed = run_trainer(tmp_path / "job", *CHECKPOINT, *remote(server_b, "snapshot"), SCHEDULE, steps=2 * N)
    assert _loaded(resumed.run.output, tmp_path / "job"), resumed.run.output[-3000:]
    assert "restored " in resumed.run.output and f"/step-{N} (step {N})" in resumed.run.output
    assert resumed.steps == list(range(N + 1, 2 * N + 1))
    assert resumed == reference[N:], resumed.run.output[-3000:] + _server_log(server_b)


@pytest.mark.timeout(240)
def test_a_rerun_with_the_same_job_id_and_no_checkpoint_trains_fresh(reference, run_trainer, start_server, tmp_path):
    server = start_server()
    flags = (*remote(server, job_id="rerun-no-checkpoint"), SCHEDULE)
    first = run_trainer(tmp_path / "first", *flags, steps=N)
    assert first == reference[:N]
    assert DROP_WARNING not in first.run.output
    # The first run's exit hook kept its segment (within --grace); a rerun from fresh weights
    # finds it and must not train on it.
    second = run_trainer(tmp_path / "second", *flags, steps=N)
    assert f"{DROP_WARNING} rerun-no-checkpoint rank 0 at step {N}" in second.run.output, second.run.output[-3000:]
    assert second == first


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["full", "snapshot"])
def test_training_again_from_an_older_checkpoint(mode, reference, run_trainer, start_server, tmp_path):
    """A fixed job id, checkpoints every step, then ``--checkpoint.load_step`` of an older kept
    one and the same steps again: torchtitan overwrites those checkpoints (in snapshot mode
    their snapshots are replaced with them, not refused as existing nor answered with the
    first attempt's), and a resume from the newest is bitwise."""
    server = start_server()
    every_step = (*CHECKPOINT[:2], "--checkpoint.interval=1", CHECKPOINT[3], "--checkpoint.keep_latest_k=0")
    flags = (*every_step, *remote(server, mode, job_id=f"trained-again-{mode}"), SCHEDULE)
    first = run_trainer(tmp_path, *flags, steps=N)
    assert first == reference[:N]
    again = run_trainer(tmp_path, *flags, "--checkpoint.load_step=1", steps=N)
    assert _loaded(again.run.output, tmp_path, step=1), again.run.output[-3000:]
    assert again.steps == list(range(2, N + 1)) and again == reference[1:N]
    resumed = run_trainer(tmp_path, *flags, steps=2 * N)
    assert _loaded(resumed.run.output, tmp_path), resumed.run.output[-3000:]
    if mode == "snapshot":
        assert f"restored trained-again-{mode}/step-{N}" in resumed.run.output, resumed.run.output[-3000:]
    assert resumed == reference[N:], resumed.run.output[-3000:] + _server_log(server)


def _export(step_dir: Path, out: Path, snapshot_dir: Path):
    return swap_state_cli("export", "--format", "torchtitan", str(step_dir), str(out), "--snapshot-dir", str(snapshot_dir))


@pytest.mark.timeout(300)
def test_export_to_plain_torchtitan_resumes_bitwise_without_swap_state(reference, run_trainer, start_server, tmp_path):
    snapshots = tmp_path / "server-snapshots"
    server = start_server(snapshot_dir=snapshots)
    first = run_trainer(tmp_path / "job", *CHECKPOINT, *remote(server, "snapshot", job_id="exported"), SCHEDULE, steps=N)
    assert first == reference[:N]
    server.stop()  # offline: the export needs no server
    plain = tmp_path / "plain"
    exported = _export(tmp_path / "job" / "ckpt" / f"step-{N}", plain / "ckpt" / f"step-{N}", snapshots)
    assert exported.returncode == 0, exported.stderr
    assert "exported/step-3" in exported.stdout
    keys = checkpoint_keys(plain / "ckpt" / f"step-{N}")
    assert "tok_embeddings.weight" in keys and "optimizer.state.tok_embeddings.weight.exp_avg" in keys
    assert not [k for k in keys if k.startswith("swap_state.") or ".swap_state." in k]
    resumed = run_trainer(plain, *CHECKPOINT, SCHEDULE, steps=2 * N)  # torch's own AdamW
    assert _loaded(resumed.run.output, plain), resumed.run.output[-3000:]
    assert resumed.steps == list(range(N + 1, 2 * N + 1))
    assert resumed == reference[N:], resumed.run.output[-3000:]


@pytest.mark.timeout(300)
def test_export_of_a_corrupt_snapshot_names_file_and_tensor_and_writes_nothing(run_trainer, start_server, tmp_path):
    snapshots = tmp_path / "server-snapshots"
    server = start_server(snapshot_dir=snapshots)
    run_trainer(tmp_path / "job", *CHECKPOINT, *remote(server, "snapshot", job_id="corrupt"), SCHEDULE, steps=N)
    server.stop()
    data = next(snapshots.glob(f"corrupt/step-*{N}/rank-00000.safetensors"))
    flip_byte_of_tensor(data, "model.tok_embeddings.weight")
    out = tmp_path / "plain" / "ckpt" / f"step-{N}"
    result = _export(tmp_path / "job" / "ckpt" / f"step-{N}", out, snapshots)
    assert result.returncode == 1
    assert str(data) in result.stderr and "model.tok_embeddings.weight" in result.stderr, result.stderr
    assert not out.exists() and not list(out.parent.glob(".*partial*")), sorted(out.parent.iterdir())
    missing = _export(tmp_path / "job" / "ckpt" / f"step-{N}", out, tmp_path / "elsewhere")
    assert missing.returncode == 1 and "elsewhere" in missing.stderr, missing.stderr


@pytest.mark.timeout(240)
def test_snapshot_mode_with_torchtitans_async_checkpointing(reference, run_trainer, start_server, tmp_path):
    """``checkpoint.async_mode = "async"``: DCP saves the references and small states on its
    thread; the resume is the same."""
    server = start_server()
    flags = (*CHECKPOINT, "--checkpoint.async_mode=async", *remote(server, "snapshot"), SCHEDULE)
    first = run_trainer(tmp_path, *flags, steps=N)
    assert first == reference[:N]
    assert MODEL_REF_KEY in checkpoint_keys(tmp_path / "ckpt" / f"step-{N}")
    resumed = run_trainer(tmp_path, *flags, steps=2 * N)
    assert _loaded(resumed.run.output, tmp_path), resumed.run.output[-3000:]
    assert resumed == reference[N:], resumed.run.output[-3000:] + _server_log(server)
