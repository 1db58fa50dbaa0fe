"""torchtitan's own trainer with swap-state, on the CPU: train, checkpoint, get killed, resume.

    bash scripts/demo.sh --torchtitan        torchtitan 0.2 (its TOML switch)
    bash scripts/demo.sh --torchtitan03      torchtitan 0.3 (its override), in .venv-titan03

What it runs, each a real process (tests/torchtitan/launcher.py runs torchtitan 0.2's own
``train.main`` on the CPU, tests/torchtitan03/launcher.py 0.3's; the tokenizer and data are
generated here, nothing is downloaded):

1. plain torchtitan, AdamW (fused), 2N steps: the reference losses;
2. the same job with swap-state in snapshot mode against a private ``swap-state-server``
   (checkpoints every N steps are server-side snapshots): killed with SIGKILL right after step
   N's checkpoint, as the OOM killer would;
3. rerun: it loads step N's checkpoint (the server restores the snapshot) and trains to 2N.

It prints the losses of every step side by side and whether they are bitwise equal; exit 0
when they are. Scratch files live in a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "torchtitan"))  # the CPU launcher and its assets
sys.path.insert(0, str(ROOT / "tests"))

import json  # noqa: E402
from functools import partial  # noqa: E402

from titan_testkit import STOP_AFTER_STEP_ENV, STOP_MODE_ENV, build_titan_assets, launch  # noqa: E402

from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig  # noqa: E402


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="N: the checkpoint and the kill come after step N; "
                        "the job trains to 2N (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (printed) afterwards")
    parser.add_argument("--line", choices=("0.2", "0.3"), default="0.2",
                        help="the torchtitan line: 0.2 (this venv) or 0.3 (.venv-titan03's python)")
    return parser.parse_args()


def _line(line: str, server: str):
    """(the launch function, swap-state's switch on that line)."""
    if line == "0.2":
        return launch, ("--job.custom_config_module=swap_state.client.torchtitan_config", "--optimizer.swap_optimizer",
                        "--optimizer.swap_optimizer_backend=remote", "--optimizer.swap_state_checkpoint=snapshot",
                        f"--optimizer.swap_state_server={server}", "--optimizer.swap_state_job_id=titan-demo")
    sys.path.insert(0, str(ROOT / "tests" / "torchtitan03"))
    from titan03_kit import launch03, locate_titan03_python, missing_reason

    python = locate_titan03_python()
    if missing_reason(python):
        raise SystemExit(missing_reason(python))
    settings = {"swap_state_checkpoint": "snapshot", "swap_state_server": server, "swap_state_job_id": "titan-demo"}
    return partial(launch03, python), ("--override.imports",
                                       f"swap_state.client.torchtitan_override.swap_state={json.dumps(settings)}")


def main() -> int:
    args = _args()
    n = args.steps
    scratch = Path(tempfile.mkdtemp(prefix="swap-state-titan-demo-"))
    shm = Path(tempfile.mkdtemp(prefix="swap-state-titan-demo-", dir="/dev/shm"))
    server = None
    try:
        print(f"generating a tokenizer and a dataset in {scratch} ...", flush=True)
        assets = build_titan_assets(scratch / "assets")
        server = EmbeddedServer(EmbeddedServerConfig(shm_size_bytes=512 << 20, server={"shm_dir": str(shm)},
                                                     snapshot_dir=str(scratch / "snapshots"))).start()
        run, swap = _line(args.line, server.address)
        if args.line == "0.2":
            schedule = (f"--lr_scheduler.total_steps={2 * n}",)
            checkpoint = ("--checkpoint.enable", "--checkpoint.folder=ckpt", f"--checkpoint.interval={n}",
                          "--checkpoint.no-last_save_model_only")
        else:  # 0.3's schedule follows training.steps; its flags are kebab-case
            schedule = ()
            checkpoint = ("--checkpoint.enable", "--checkpoint.folder", "ckpt", "--checkpoint.interval", str(n),
                          "--checkpoint.no-last-save-model-only")
        print(f"1/3 plain torchtitan {args.line}, AdamW, {2 * n} steps ...", flush=True)
        plain = run(assets, scratch / "plain", *schedule, steps=2 * n)
        print(f"2/3 swap-state (server {server.address}), killed with SIGKILL after step {n}'s checkpoint ...",
              flush=True)
        killed = run(assets, scratch / "swap", *schedule, *checkpoint, *swap, steps=2 * n,
                     env={STOP_AFTER_STEP_ENV: str(n), STOP_MODE_ENV: "kill"}, expect_returncode=-9)
        print(f"3/3 rerun: resumes from step {n}'s checkpoint (a server-side snapshot) ...", flush=True)
        resumed = run(assets, scratch / "swap", *schedule, *checkpoint, *swap, steps=2 * n)
        return _report(plain.by_step(), {**killed.by_step(), **resumed.by_step()}, resumed.steps, n)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _report(plain: dict[int, str], swap: dict[int, str], resumed_steps: list[int], n: int) -> int:
    print(f"\n{'step':>4}  {'plain AdamW':>24}  {'swap-state':>24}")
    for step in sorted(plain):
        mark = "" if plain[step] == swap.get(step) else "   <- differs"
        print(f"{step:>4}  {float.fromhex(plain[step]):>24.17g}  "
              f"{float.fromhex(swap[step]) if step in swap else float('nan'):>24.17g}{mark}")
    equal = plain == swap and resumed_steps == list(range(n + 1, 2 * n + 1))
    print(f"\nresumed at step {resumed_steps[0] if resumed_steps else '?'} after the kill; "
          f"losses bitwise equal to plain AdamW: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
