"""Run torchtitan 0.3's own trainer (``torchtitan.train.main``) on the CPU, in one process.

    <.venv-titan03>/bin/python tests/torchtitan03/launcher.py --module llama3 \\
        --config llama3_debugmodel [--section.key value ...] [--override.imports T ...]

The torchtitan 0.3 counterpart of ``tests/torchtitan/launcher.py``, with the same environment
contract (``SWAP_STATE_TEST_LOSS_FILE``, ``SWAP_STATE_TEST_STOP_AFTER_STEP``,
``SWAP_STATE_TEST_STOP_MODE`` = return | exit | kill, ``SWAP_STATE_TEST_STOP_EXIT_CODE``) and
the same version-neutral shims, imported from ``tests/torchtitan/cpu_shims.py``: torchrun's
rank-0 environment, torchtitan's device globals set to the CPU before its first import (0.3
copies them into metrics, distributed/utils, parallel_dims, profiler and token_dispatcher),
gloo-safe FSDP reductions (0.3 applies FSDP even on one rank: parameters are DTensors).

What 0.3 needs beyond 0.2, each applied before ``main`` runs and none editing torchtitan:

* ``torch.distributed.set_timeout``, which 0.3's ``set_pg_timeouts`` calls after the first
  step, is not in torch 2.13: it is supplied as c10d's ``_set_pg_timeout`` (same arguments).
* llama3's FlexAttention has no CPU backward: ``cpu_overrides.cpu_sdpa_attention`` (next to
  this file) is appended to the parsed config's ``override.imports``, after whatever the
  config registry and the caller's ``--override.imports`` put there, so all of them apply.
* 0.3's ``train.main()`` takes no trainer class (``config.build()`` makes the Trainer), so the
  observation patches the classes in place, which also covers Trainer subclasses that call
  ``super()``: ``MetricsProcessor.log`` records ``(step, global_avg_loss)``, the loss exactly
  as torchtitan logs it (one rank: ``float(accumulated_loss.item())``, the sum of the
  microbatch losses ``forward_backward_step`` returned; several ranks: the all-reduced value,
  written by rank 0). Only logged steps are recorded: keep ``--metrics.log_freq 1``.
  ``Trainer.should_continue_training`` stops after ``SWAP_STATE_TEST_STOP_AFTER_STEP``
  (that step's checkpoint, if due, is written first).
* 0.3's pipeline step hands the schedule pre-split microbatches,
  ``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...)``
  (``Trainer.pp_forward_backward_step``), keywords torch 2.13 lacks (0.3 is built against
  PyTorch nightly): torch 2.13's
  ``step(*args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs)``
  takes one whole batch and splits it itself, so those three names land in ``**kwargs`` as
  model inputs, are chunked like a batch (a list of 1-sample tensors cannot be cut into 2),
  and ``_check_inputs`` fails: "Expecting 2 arg_mbs but got 1". No flag avoids it (every
  schedule's ``step`` is torch's; ``spmd-backend`` and CUDA graphs do not touch it).
  ``accept_presplit_microbatches`` gives torch 2.13's single- and multi-stage schedules the
  newer keywords: what their own ``step`` does before and after splitting (``has_backward``
  and runtime states of each stage), with the caller's microbatches given to the schedule's
  own ``_step_microbatches`` (which takes exactly these lists and ``loss_kwargs``). Without
  those keywords ``step`` is torch's own.
* At the end of ``train()`` rank 0 sleeps 2 s "for other ranks to complete"; with
  ``WORLD_SIZE=1`` there are none, so that one sleep is skipped (a fifth of a 6-step run).
"""

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# This folder (cpu_overrides, which torchtitan imports by name) and the 0.2 harness's shims.
for _path in (HERE, HERE.parent / "torchtitan"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from cpu_shims import (
    StepObserver,
    import_torchtitan_on_cpu,
    set_torchrun_env,
    sum_reductions_for_gloo,
)

#: The ``module.function`` of cpu_overrides.py's override (see that module).
CPU_ATTENTION_OVERRIDE = "cpu_overrides.cpu_sdpa_attention"


def supply_set_timeout() -> None:
    """``torch.distributed.set_timeout(timeout, group)`` where torch lacks it (2.13)."""
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_timeout(timeout, group=None) -> None:
        _set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


class _TimeWithoutSleep:
    """``time`` as torchtitan.trainer sees it, less ``sleep`` (its only sleep is that wait)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def skip_lone_rank_wait() -> None:
    """No 2 s wait for other ranks at the end of training when the job has one rank."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return
    import torchtitan.trainer as tt_trainer

    tt_trainer.time = _TimeWithoutSleep()


def accept_presplit_microbatches() -> None:
    """torch's pipeline schedules' ``step`` also takes ``arg_mbs``/``kwarg_mbs``/``target_mbs``
    (microbatches already split, as torchtitan 0.3 passes them), where torch lacks them."""
    import inspect

    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        original = cls.step
        if "arg_mbs" in inspect.signature(original).parameters:
            continue  # a torch that has them

        def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                 return_outputs=True, loss_kwargs=None, _original=original, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _original(self, *args, losses=losses, return_outputs=return_outputs,
                                 loss_kwargs=loss_kwargs, **kwargs)
            if args or kwargs:
                raise TypeError(f"pre-split microbatches and whole-batch inputs together: {args} {sorted(kwargs)}")
            needs_grad = self._has_backward and getattr(self, "_backward_requires_autograd", True)
            if needs_grad and not torch.is_grad_enabled():
                raise RuntimeError("step() requires gradients to be enabled; call eval() instead")
            stages = self._stages if hasattr(self, "_stages") else [self._stage]
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                    loss_kwargs=loss_kwargs)
            for stage in stages:
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

        cls.step = step


def _override_target(entry) -> str:
    """An ``override.imports`` entry is a target or a ``(target, kwargs)`` pair."""
    return entry if isinstance(entry, str) else entry[0]


def append_cpu_attention_override() -> None:
    """Every parsed config also activates the CPU attention override (once)."""
    from torchtitan.config import ConfigManager

    original = ConfigManager.parse_args

    def parse_args(self, args=None):
        config = original(self, args)
        imports = config.override.imports
        if CPU_ATTENTION_OVERRIDE not in [_override_target(e) for e in imports]:
            imports.append(CPU_ATTENTION_OVERRIDE)
        return config

    ConfigManager.parse_args = parse_args


def observe_trainer(observer: StepObserver) -> None:
    """Loss record at torchtitan's own metrics log; the stop after a given step."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer

    original_log = MetricsProcessor.log
    original_continue = Trainer.should_continue_training

    def log(self, step, global_avg_loss, *args, **kwargs):
        observer.record_loss(step, global_avg_loss)
        return original_log(self, step, global_avg_loss, *args, **kwargs)

    def should_continue_training(self) -> bool:
        if observer.stop_here(self.step, logger):
            return False
        return original_continue(self)

    MetricsProcessor.log = log
    Trainer.should_continue_training = should_continue_training


def main(argv=None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    set_torchrun_env()
    observer = StepObserver.from_env()  # a bad stop mode fails before the slow import
    tt_train = import_torchtitan_on_cpu()
    sum_reductions_for_gloo()
    supply_set_timeout()
    accept_presplit_microbatches()
    append_cpu_attention_override()
    observe_trainer(observer)
    skip_lone_rank_wait()
    # torchtitan's own entry: init_logger, ConfigManager().parse_args() over sys.argv[1:]
    # (--module/--config pick the config registry function), config.build() (the Trainer,
    # overrides applied), train() (with its CheckpointManager), close().
    tt_train.main()


if __name__ == "__main__":
    main()
