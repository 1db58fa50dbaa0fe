"""Run torchtitan's own trainer (``torchtitan.train.main``) on the CPU, in one process.

    python tests/torchtitan/launcher.py --job.config_file X.toml [--section.key value ...]
    python -m tests.torchtitan.launcher ...          (same, from the repository root)

torchtitan 0.2.2 cannot run without an accelerator as shipped: ``torchtitan/tools/utils.py``
computes ``device_type, device_module`` once at import time as
``_get_available_device_type() or "cuda"``, and half of torchtitan copies those two names into
its own modules with ``from torchtitan.tools.utils import device_module, device_type``
(components/metrics.py, distributed/utils.py, distributed/parallel_dims.py, tools/profiling.py).
So, before the first torchtitan import, this launcher makes ``torch._utils`` answer "cpu" and a
CPU device module (below) for the duration of that import, then restores torch, so every copy
says "cpu" and torch itself is untouched. What follows from ``device_type == "cpu"`` is
torchtitan's own code: ``torch.device("cpu:0")``, the "gloo" backend (torch's
``default_device_backend_map["cpu"]``), a CPU device mesh, ``torch.autocast("cpu")``.

The CPU device module is ``torch.cpu`` plus what torchtitan calls on ``torch.cuda`` that
``torch.cpu`` lacks: ``DeviceMemoryMonitor`` (``get_device_name``, ``get_device_properties``,
``memory_stats``, ``reset_peak_memory_stats``, ``empty_cache``) and ``set_pg_timeouts``'s
``barrier(device_ids=[current_device()])``, which needs an int. The memory numbers it reports
are the process's peak RSS and the host's RAM.

The environment torchrun would give rank 0 of 1 is set when absent (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), and the Hugging Face
libraries are put offline (nothing is downloaded).

The trainer class is a subclass of ``torchtitan.train.Trainer`` that only observes:

* ``SWAP_STATE_TEST_LOSS_FILE=path``: every step appends ``{"step": n, "loss": float.hex()}``
  to that JSON-lines file. The loss is the value torchtitan itself logs for a step without
  data parallelism: ``torch.sum(torch.stack(microbatch_losses)).item()`` of the detached
  losses ``forward_backward_step`` returned, reduced exactly as ``train_step`` does. Under
  torchrun with several ranks, rank 0 writes its own (local) loss.
* ``SWAP_STATE_TEST_STOP_AFTER_STEP=n``: after step n (its checkpoint, if due, is written),
  the run stops: ``SWAP_STATE_TEST_STOP_MODE=return`` (default) leaves the loop as if
  ``training.steps`` were reached (the trainer closes normally, without a last-step save);
  ``exit`` ends the process at once with ``os._exit(SWAP_STATE_TEST_STOP_EXIT_CODE``, default
  43), like a crash: nothing is closed or flushed beyond the loss file; ``kill`` sends the
  process SIGKILL (no exit code, no atexit, no finally: what the OOM killer does).

Under torchrun with FSDP, gloo lacks the PREMUL_SUM reduction torchtitan's divide factor of
1.0 asks for: FSDP is told to use SUM instead (:func:`sum_reductions_for_gloo`; multiplying by
1.0 is exact). MoE models count tokens and permute them as the CPU can (:func:`moe_on_cpu`).
Rank 0 does not sleep the 2 s ``train()`` ends with "for other ranks to complete"
(:func:`no_final_sleep`).
Nothing here edits torchtitan's files or changes numerics.
"""

import os
import sys
import time

# The version-neutral shims live in cpu_shims.py, shared with tests/torchtitan03/launcher.py;
# they are re-exported here for bench/ (``launcher.make_trainer_class`` ...). This folder on
# sys.path first: ``python -m tests.torchtitan.launcher`` does not put it there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_shims import (  # noqa: E402, F401
    DEFAULT_STOP_EXIT_CODE,
    LOSS_FILE_ENV,
    STOP_AFTER_STEP_ENV,
    STOP_EXIT_CODE_ENV,
    STOP_MODE_ENV,
    check_device_globals,
    import_torchtitan_on_cpu,
    make_cpu_device_module,
    make_trainer_class,
    moe_on_cpu,
    set_torchrun_env,
    sum_reductions_for_gloo,
)


def main(argv=None) -> None:
    # Before any torchtitan import: ConfigManager.parse_args's default argument is
    # ``sys.argv[1:]`` evaluated when torchtitan.config.manager is imported.
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    set_torchrun_env()
    tt_train = import_torchtitan_on_cpu()
    sum_reductions_for_gloo()
    moe_on_cpu()
    no_final_sleep(tt_train)
    # torchtitan's own entry: init_logger, ConfigManager().parse_args() over sys.argv (custom
    # config modules included), Trainer(config), train() (with its CheckpointManager), close().
    tt_train.main(make_trainer_class(tt_train))


class _TimeWithoutSleep:
    """The ``time`` module as ``torchtitan.train`` sees it, but for ``sleep``: its one call is
    rank 0's 2 s at the end of ``train()`` (0.2.2; 0.3 has none), after the last step and its
    checkpoint, before the process groups close. Two fifths of a short test run's time, and
    nothing waits on it: every rank left the loop's last collective already."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def no_final_sleep(tt_train) -> None:
    if getattr(tt_train, "time", None) is time:
        tt_train.time = _TimeWithoutSleep()


if __name__ == "__main__":
    main()
