"""torchtitan 0.2.2's own Trainer on the CPU (tests/torchtitan's launcher), end to end:

1. plain AdamW runs to step 4 and checkpoints;
2. the same job reruns under swap-state (remote backend, private embedded server, "snapshot"
   checkpoints every step, ``keep_latest_k = 3``): it resumes from the plain checkpoint (the
   moments come from it), its losses are the plain run's bit for bit, its snapshots are under
   ``<dump_folder>/swap-state-snapshots`` and exactly those of the checkpoints torchtitan keeps
   remain there (four: keep_latest_k plus the unpurged last-step save; the embedded server's
   own --keep-latest is 2);
3. a third run loads the oldest checkpoint kept (``--checkpoint.load_step``): a new embedded
   server restores its snapshot from the dump folder, and the losses are again the plain run's.

Losses are compared as float.hex() strings against one uninterrupted plain AdamW run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from titan_testkit import launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 8
SCHEDULE = f"--lr_scheduler.total_steps={STEPS}"
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.folder=ckpt", "--checkpoint.no-last_save_model_only")
SWAP = (
    "--job.custom_config_module=swap_state.client.torchtitan_config",
    "--optimizer.swap_optimizer",
    "--optimizer.swap_optimizer_times=3",
    "--optimizer.swap_optimizer_backend=remote",
    "--optimizer.swap_state_checkpoint=snapshot",
    "--checkpoint.interval=1",
    "--checkpoint.keep_latest_k=3",
)


def _snapshot_steps(dump: Path) -> dict[str, list[int]]:
    root = dump / "swap-state-snapshots"
    return {
        job.name: sorted(int(p.name.split("-")[1]) for p in job.iterdir() if p.name.startswith("step-"))
        for job in sorted(root.iterdir())
        if job.is_dir()
    }


def test_plain_checkpoint_then_swap_state_snapshots_then_the_oldest_kept(titan_assets, no_server_env, tmp_path):
    reference = launch(titan_assets, tmp_path / "reference", SCHEDULE, steps=STEPS)
    assert reference.steps == list(range(1, STEPS + 1))

    dump = tmp_path / "job"
    plain = launch(titan_assets, dump, *CHECKPOINT, SCHEDULE, "--checkpoint.interval=4", steps=4)
    assert plain.losses == reference.losses[:4]

    swap = launch(titan_assets, dump, *CHECKPOINT, SCHEDULE, *SWAP, steps=STEPS)
    assert f"Loading the checkpoint from {dump / 'ckpt' / 'step-4'}" in swap.output
    assert swap.steps == list(range(5, STEPS + 1))
    assert swap.losses == reference.losses[4:]
    # torchtitan keeps keep_latest_k=3 and, after its last-step save (which does not purge),
    # one more: every one of them must load, so the server keeps 4, not its --keep-latest 2.
    kept = sorted(int(p.name.split("-")[1]) for p in (dump / "ckpt").iterdir() if p.name.startswith("step-"))
    assert kept == [5, 6, 7, 8]
    [(job, steps)] = _snapshot_steps(dump).items()
    assert steps == kept
    assert f"first snapshot {job}/step-5 goes to {dump / 'swap-state-snapshots' / job}" in swap.output

    oldest = launch(titan_assets, dump, *CHECKPOINT, SCHEDULE, *SWAP, "--checkpoint.load_step=5", steps=STEPS)
    assert f"Loading the checkpoint from {dump / 'ckpt' / 'step-5'}" in oldest.output
    assert f"restored {job}/step-5" in oldest.output
    assert oldest.steps == [6, 7, 8]
    assert oldest.losses == reference.losses[5:]
