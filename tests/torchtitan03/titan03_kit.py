"""torchtitan 0.3's own trainer on the CPU, run from the main venv's pytest as a subprocess.

The pytest process imports torchtitan 0.2 (the main venv); 0.3 lives in a second venv, so
every 0.3 run is ``<0.3 python> tests/torchtitan03/launcher.py ...`` (see that launcher for
the CPU shims and the environment contract). What the 0.2 harness already has is imported
from ``tests/torchtitan/titan_testkit.py``, not copied: the offline assets (WordLevel
tokenizer of llama3 debugmodel's 2048 words, a ``c4_test``-layout dataset), ``TrainerRun``,
``TrainerRunError``, the loss-file reader and the launcher environment.

* :func:`locate_titan03_python`: ``$SWAP_STATE_TITAN03_PYTHON``, else ``<repo>/.venv-titan03/bin/python``;
  :func:`missing_reason` says why it cannot be used and how to build it.
* :func:`base_flags03`: the tiny llama3 debugmodel job in 0.3's names (seq 64, batch 2, fp32
  parameters, no compile, no activation checkpointing, checkpoints off, log every step, fixed
  seed, deterministic); the same job as the 0.2 kit's ``base_flags``.
* :func:`launch03`: one run in its own process group, killed as a group on a timeout or when
  the caller leaves early (:class:`ProcessGroups`), returning the recorded losses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
LAUNCHER03 = HERE / "launcher.py"
if str(HERE.parent / "torchtitan") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "torchtitan"))  # titan_testkit, shared with 0.2

from titan_testkit import (  # noqa: F401 (Losses, as_losses: this kit's fixtures' shape)
    BATCH,
    LOSS_FILE_ENV,
    SEQ_LEN,
    Losses,
    TitanAssets,
    TrainerRun,
    TrainerRunError,
    WARM,
    _tail,
    as_losses,
    finished_run,
    fresh_loss_file,
    launcher_env,
    rank_threads,
    runner_argv,
)

TITAN03_PYTHON_ENV = "SWAP_STATE_TITAN03_PYTHON"
DEFAULT_VENV = REPO_ROOT / ".venv-titan03"
BUILD_COMMAND = "SWAP_STATE_VENV=.venv-titan03 SWAP_STATE_TORCHTITAN='torchtitan==0.3.0' bash scripts/setup.sh"
DEFAULT_TIMEOUT_S = 240.0
#: tyro's subcommand for activation checkpointing; a subcommand must follow every root flag.
AC_SUBCOMMAND_PREFIX = "activation-checkpoint:"
NO_ACTIVATION_CHECKPOINT = "activation-checkpoint:none"


def locate_titan03_python() -> Path:
    """The 0.3 venv's python: ``$SWAP_STATE_TITAN03_PYTHON`` or ``<repo>/.venv-titan03``'s."""
    named = os.environ.get(TITAN03_PYTHON_ENV, "")
    return Path(named) if named else DEFAULT_VENV / "bin" / "python"


def missing_reason(python: Path) -> str | None:
    """Why ``python`` cannot run the 0.3 trainer (None when it can be tried)."""
    if python.is_file() and os.access(python, os.X_OK):
        return None
    source = f"${TITAN03_PYTHON_ENV}" if os.environ.get(TITAN03_PYTHON_ENV) else "the default"
    return (f"torchtitan 0.3's venv is missing: {python} ({source}) is not an executable; "
            f"build it from the repository root with: {BUILD_COMMAND}")


def torchtitan_version(python: Path, timeout: float = 60.0) -> str:
    """The torchtitan distribution's version in ``python``'s environment (no torch import)."""
    probe = "import importlib.metadata as m; print(m.version('torchtitan'))"
    proc = subprocess.run([str(python), "-c", probe], check=False, capture_output=True, text=True,
                          timeout=timeout, env=_for_titan03(dict(os.environ)), cwd=str(REPO_ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"{python} has no torchtitan: {proc.stderr.strip()[-2000:]}")
    return proc.stdout.strip()


def base_flags03(assets: TitanAssets, dump_folder: str | os.PathLike, *, steps: int = 6) -> list[str]:
    """The tiny debugmodel job (root flags only: later flags override these)."""
    return [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--dump-folder", str(dump_folder),
        "--hf-assets-path", str(assets.tokenizer_dir),
        "--dataloader.dataset", "c4_test",
        "--dataloader.dataset-path", str(assets.dataset_dir),
        "--training.seq-len", str(SEQ_LEN),
        "--training.local-batch-size", str(BATCH),
        "--training.steps", str(steps),
        "--training.dtype", "float32",
        "--training.mixed-precision-param", "float32",
        "--training.max-norm", "1.0",
        "--optimizer.implementation", "fused",
        "--optimizer.param-groups.0.optimizer-kwargs.lr", "0.008",
        "--lr-scheduler.warmup-steps", "2",
        "--compile.no-enable",
        "--checkpoint.no-enable",
        "--metrics.log-freq", "1",
        "--metrics.disable-color-printing",
        "--comm.trace-buf-size", "0",
        "--debug.seed", "42",
        "--debug.deterministic",
        "--debug.no-enable-structured-logging",
    ]  # fmt: skip


def job_argv(assets: TitanAssets, dump_folder: Path, flags: tuple[str, ...], steps: int) -> list[str]:
    """Base flags, the caller's, then no activation checkpointing unless the caller chose."""
    chosen_ac = any(flag.startswith(AC_SUBCOMMAND_PREFIX) for flag in flags)
    tail = [] if chosen_ac else [NO_ACTIVATION_CHECKPOINT]
    return [*base_flags03(assets, dump_folder, steps=steps), *flags, *tail]


def _for_titan03(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what points into the main venv: its PYTHONPATH and VIRTUAL_ENV."""
    return {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


class ProcessGroups:
    """Children started in their own sessions, killed as whole groups (SIGKILL) on a
    timeout or by :meth:`kill_all` (a fixture's teardown), so nothing outlives a test."""

    def __init__(self) -> None:
        self._live: list[subprocess.Popen] = []

    def run(self, argv: list[str], *, env: dict[str, str], log_path: Path, timeout: float) -> tuple[int | None, float]:
        """(returncode or None on timeout, wall seconds); stdout+stderr go to ``log_path``."""
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=str(REPO_ROOT), env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._live.append(proc)
        try:
            return proc.wait(timeout=timeout), time.monotonic() - start
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - start
        finally:
            self._kill(proc)

    def _kill(self, proc: subprocess.Popen) -> None:
        # The group too: a child the trainer started would otherwise outlive it.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if proc in self._live:
            self._live.remove(proc)

    def kill_all(self) -> None:
        for proc in list(self._live):
            self._kill(proc)


def launch03(
    python: Path,
    assets: TitanAssets,
    dump_folder: str | os.PathLike,
    *flags: str,
    steps: int = 6,
    env: dict[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
    expect_returncode: int = 0,
    groups: ProcessGroups | None = None,
    nproc: int = 1,
) -> TrainerRun:
    """Run the 0.3 launcher on :func:`job_argv` and read back its losses (``nproc`` ranks
    under torchrun when above 1, gloo on the CPU; rank 0 records the losses).

    ``env`` is added last. Each call writes ``<dump>/losses-<n>.jsonl`` and
    ``<dump>/output-<n>.log`` (fresh ``n``). A timeout always raises :class:`TrainerRunError`;
    with ``check`` so does a return code other than ``expect_returncode`` (both with the
    output's tail)."""
    dump_folder = Path(dump_folder)
    dump_folder.mkdir(parents=True, exist_ok=True)
    loss_file = fresh_loss_file(dump_folder)
    log_path = loss_file.with_name(loss_file.name.replace("losses-", "output-").replace(".jsonl", ".log"))
    loss_file.write_text("")
    run_env = _for_titan03(launcher_env(assets, {LOSS_FILE_ENV: str(loss_file)}))
    run_env.setdefault("OMP_NUM_THREADS", rank_threads(nproc))
    run_env.update(env or {})
    argv = [*runner_argv(str(python), nproc, warm=WARM.argv(str(python), run_env)), str(LAUNCHER03),
            *job_argv(assets, dump_folder, flags, steps)]

    returncode, wall = (groups or ProcessGroups()).run(argv, env=run_env, log_path=log_path, timeout=timeout)
    output = log_path.read_text(errors="replace")
    if returncode is None:
        raise TrainerRunError(f"trainer timed out after {timeout}s: {' '.join(argv)}\n{_tail(output)}")
    return finished_run(argv, loss_file, returncode, output, wall, check=check, expect_returncode=expect_returncode)
