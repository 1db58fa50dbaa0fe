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
1.0 is exact). Nothing here edits torchtitan's files or changes numerics.
"""

import json
import os
import resource
import signal
import socket
import sys
import types

LOSS_FILE_ENV = "SWAP_STATE_TEST_LOSS_FILE"
STOP_AFTER_STEP_ENV = "SWAP_STATE_TEST_STOP_AFTER_STEP"
STOP_MODE_ENV = "SWAP_STATE_TEST_STOP_MODE"
STOP_EXIT_CODE_ENV = "SWAP_STATE_TEST_STOP_EXIT_CODE"
DEFAULT_STOP_EXIT_CODE = 43


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_torchrun_env() -> None:
    """The variables torchrun sets for rank 0 of a 1-process job (kept where already set)."""
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("GROUP_RANK", "0"),
        ("ROLE_RANK", "0"),
        ("ROLE_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, value)
    if not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(_free_port())
    # No network: datasets and the hub read only local files.
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def make_cpu_device_module():
    """``torch.cpu`` with the ``torch.cuda`` calls torchtitan makes on its device module."""
    import torch

    def _host_ram() -> int:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 1 << 40

    def _peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    module = types.ModuleType("torchtitan_cpu_device_module")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    module.__doc__ = make_cpu_device_module.__doc__
    module.is_available = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: 0  # an index: barrier(device_ids=[current_device()])
    module.set_device = lambda device=None: None
    module.synchronize = lambda device=None: None
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=_host_ram()
    )
    module.memory_stats = lambda device=None: {
        "active_bytes.all.peak": _peak_rss(),
        "reserved_bytes.all.peak": _peak_rss(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    return module


def import_torchtitan_on_cpu():
    """Import torchtitan with its device globals set to ("cpu", CPU device module)."""
    import torch._utils as torch_utils

    if any(name == "torchtitan" or name.startswith("torchtitan.") for name in sys.modules):
        raise RuntimeError("torchtitan was imported before the CPU launcher could patch it")

    cpu_module = make_cpu_device_module()
    saved = torch_utils._get_available_device_type, torch_utils._get_device_module
    torch_utils._get_available_device_type = lambda: "cpu"
    torch_utils._get_device_module = lambda device=None: (
        cpu_module if device in (None, "cpu") else saved[1](device)
    )
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        torch_utils._get_available_device_type, torch_utils._get_device_module = saved

    # Modules imported later (e.g. distributed/dual_pipe_v.py) call get_device_info() again.
    tt_utils.get_device_info = lambda: ("cpu", cpu_module)
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module

    import torchtitan.train as tt_train

    check_device_globals(cpu_module)
    return tt_train


def sum_reductions_for_gloo() -> None:
    """FSDP on gloo: torchtitan sets every FSDP module's gradient divide factor to 1.0 (it
    scales gradients itself), which FSDP turns into ``ReduceOp.PREMUL_SUM``, a NCCL-only op
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Each such module is also told to use plain
    SUM reductions (``set_force_sum_reduction_for_comms``), with the factor applied apart:
    a factor of 1.0 either way, so the numbers are the same."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def check_device_globals(cpu_module) -> None:
    """Every imported torchtitan module that copied the device globals holds the CPU ones."""
    wrong = []
    for name, module in list(sys.modules.items()):
        if not (name == "torchtitan" or name.startswith("torchtitan.")) or module is None:
            continue
        d = getattr(module, "__dict__", {})
        if "device_type" in d and isinstance(d["device_type"], str) and d["device_type"] != "cpu":
            wrong.append(f"{name}.device_type={d['device_type']!r}")
        if "device_module" in d and isinstance(d["device_module"], types.ModuleType):
            if d["device_module"] is not cpu_module:
                wrong.append(f"{name}.device_module={d['device_module'].__name__}")
    if wrong:
        raise RuntimeError("torchtitan kept non-CPU device globals: " + ", ".join(wrong))


def make_trainer_class(tt_train):
    """torchtitan's Trainer, observed: per-step loss record and an optional early stop."""
    import torch

    loss_file = os.environ.get(LOSS_FILE_ENV, "")
    stop_after = int(os.environ.get(STOP_AFTER_STEP_ENV, "0") or 0)
    stop_mode = os.environ.get(STOP_MODE_ENV, "return")
    if stop_mode not in ("return", "exit", "kill"):
        raise ValueError(f"{STOP_MODE_ENV} must be 'return', 'exit' or 'kill', not {stop_mode!r}")
    exit_code = int(os.environ.get(STOP_EXIT_CODE_ENV, str(DEFAULT_STOP_EXIT_CODE)))

    class CpuTestTrainer(tt_train.Trainer):
        _step_losses: list | None = None

        def forward_backward_step(self, *args, **kwargs):
            loss = super().forward_backward_step(*args, **kwargs)
            if self._step_losses is not None:
                self._step_losses.append(loss.detach())
            return loss

        def train_step(self, data_iterator):
            self._step_losses = losses = []
            try:
                result = super().train_step(data_iterator)
            finally:
                self._step_losses = None
            if loss_file and losses and os.environ.get("RANK", "0") == "0":
                # The reduction train_step applies before logging (1 rank: no all-reduce).
                value = torch.sum(torch.stack(losses)).item()
                record = {"step": self.step, "loss": float(value).hex()}
                with open(loss_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            return result

        def should_continue_training(self) -> bool:
            if stop_after and self.step >= stop_after:
                tt_train.logger.info(f"[cpu launcher] stopping after step {self.step} ({stop_mode})")
                if stop_mode in ("exit", "kill"):
                    sys.stdout.flush()
                    sys.stderr.flush()
                    if stop_mode == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    os._exit(exit_code)
                return False
            return super().should_continue_training()

    return CpuTestTrainer


def main(argv=None) -> None:
    # Before any torchtitan import: ConfigManager.parse_args's default argument is
    # ``sys.argv[1:]`` evaluated when torchtitan.config.manager is imported.
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    set_torchrun_env()
    tt_train = import_torchtitan_on_cpu()
    sum_reductions_for_gloo()
    # torchtitan's own entry: init_logger, ConfigManager().parse_args() over sys.argv (custom
    # config modules included), Trainer(config), train() (with its CheckpointManager), close().
    tt_train.main(make_trainer_class(tt_train))


if __name__ == "__main__":
    main()
