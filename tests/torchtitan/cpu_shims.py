"""What makes torchtitan's own trainer run on the CPU, for every torchtitan line the tests run.

Shared by ``tests/torchtitan/launcher.py`` (torchtitan 0.2) and ``tests/torchtitan03/launcher.py``
(torchtitan 0.3), so that both launchers answer the same environment contract the same way:
rank 0 of a 1-process torchrun job, torchtitan's device globals set to the CPU before its first
import, gloo-safe FSDP reductions, and the per-step observation (loss file, stop after a step).
What differs between the lines (where a step's loss is seen, how the trainer class is chosen,
the shims one torchtitan needs) stays in each launcher; the 0.2 trainer subclass
(:func:`make_trainer_class`) lives here only because bench/ imports it through
``tests/torchtitan/launcher.py``. See that launcher's docstring for why each shim exists.
"""

import json
import os
import resource
import signal
import socket
import sys
import types
from dataclasses import dataclass

LOSS_FILE_ENV = "SWAP_STATE_TEST_LOSS_FILE"
STOP_AFTER_STEP_ENV = "SWAP_STATE_TEST_STOP_AFTER_STEP"
STOP_MODE_ENV = "SWAP_STATE_TEST_STOP_MODE"
STOP_EXIT_CODE_ENV = "SWAP_STATE_TEST_STOP_EXIT_CODE"
LOSS_RANK_ENV = "SWAP_STATE_TEST_LOSS_RANK"
"""The rank that records the losses (default 0; a pipeline's last stage holds the real loss)."""
DEFAULT_STOP_EXIT_CODE = 43
STOP_MODES = ("return", "exit", "kill")


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
    """Import torchtitan with its device globals set to ("cpu", CPU device module).

    Both lines compute them once in ``torchtitan/tools/utils.py`` from ``torch._utils``'s
    device helpers (0.3 also binds the helpers themselves at import), and other modules copy
    them at their own import; so torch answers "cpu" while that module is imported."""
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


def moe_on_cpu() -> None:
    """torchtitan's MoE as shipped needs an accelerator in two places; both get what the CPU
    has, for plain and swap-state runs alike (the numbers are compared between them):

    * the router counts tokens per expert with ``torch.histc`` on int64 indices, which the
      CPU does not implement (``"histogram_cpu" not implemented for 'Long'``): integer input is
      counted in float64 (exact for any count a test makes) and cast back;
    * expert parallel permutes tokens with a Triton kernel unless ``use_cpu=True``: the
      permutation is given torchtitan's own ``fill_indices_cpu`` (``use_cpu=True``).
    """
    import functools

    import torch

    histc = torch.histc

    def histc_any_dtype(input, *args, **kwargs):
        if input.dtype.is_floating_point:
            return histc(input, *args, **kwargs)
        return histc(input.to(torch.float64), *args, **kwargs).to(input.dtype)

    torch.histc = histc_any_dtype
    try:
        from torchtitan.models.moe import utils as moe_utils
    except ImportError:  # a torchtitan without MoE
        return
    moe_utils.generate_permute_indices = functools.partial(moe_utils.generate_permute_indices, use_cpu=True)


def check_device_globals(cpu_module) -> None:
    """Every imported torchtitan module that copied the device globals holds the CPU ones."""
    wrong = []
    for name, module in list(sys.modules.items()):
        if not (name == "torchtitan" or name.startswith("torchtitan.")) or module is None:
            continue
        d = getattr(module, "__dict__", {})
        if "device_type" in d and isinstance(d["device_type"], str) and d["device_type"] != "cpu":
            wrong.append(f"{name}.device_type={d['device_type']!r}")
        module_copy = d.get("device_module")
        if isinstance(module_copy, types.ModuleType) and module_copy is not cpu_module:
            wrong.append(f"{name}.device_module={module_copy.__name__}")
    if wrong:
        raise RuntimeError("torchtitan kept non-CPU device globals: " + ", ".join(wrong))


@dataclass(frozen=True)
class StepObserver:
    """The launchers' observation contract, read from the environment once per process.

    ``record_loss`` appends ``{"step": n, "loss": float.hex()}`` (rank 0 only, fsync'd so a
    killed run keeps its lines); ``stop_here`` says whether training ends after a step, and for
    the ``exit`` / ``kill`` modes ends the process there without returning."""

    loss_file: str = ""
    stop_after: int = 0
    stop_mode: str = "return"
    exit_code: int = DEFAULT_STOP_EXIT_CODE
    loss_rank: int = 0

    @classmethod
    def from_env(cls) -> "StepObserver":
        stop_mode = os.environ.get(STOP_MODE_ENV, "return")
        if stop_mode not in STOP_MODES:
            raise ValueError(f"{STOP_MODE_ENV} must be 'return', 'exit' or 'kill', not {stop_mode!r}")
        return cls(
            loss_file=os.environ.get(LOSS_FILE_ENV, ""),
            stop_after=int(os.environ.get(STOP_AFTER_STEP_ENV, "0") or 0),
            stop_mode=stop_mode,
            exit_code=int(os.environ.get(STOP_EXIT_CODE_ENV, str(DEFAULT_STOP_EXIT_CODE))),
            loss_rank=int(os.environ.get(LOSS_RANK_ENV, "0") or 0),
        )

    @property
    def records_losses(self) -> bool:
        """A loss file was asked for and this is the loss rank (torchrun's RANK; 0 when alone)."""
        return bool(self.loss_file) and os.environ.get("RANK", "0") == str(self.loss_rank)

    def record_loss(self, step: int, value: float) -> None:
        if not self.records_losses:
            return
        record = {"step": int(step), "loss": float(value).hex()}
        with open(self.loss_file, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def stop_here(self, step: int, logger) -> bool:
        """True when the run should leave its loop after ``step`` (its checkpoint written)."""
        if not (self.stop_after and step >= self.stop_after):
            return False
        logger.info(f"[cpu launcher] stopping after step {step} ({self.stop_mode})")
        if self.stop_mode in ("exit", "kill"):
            sys.stdout.flush()
            sys.stderr.flush()
            if self.stop_mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(self.exit_code)
        return True


def make_trainer_class(tt_train):
    """torchtitan 0.2's Trainer, observed: per-step loss record and an optional early stop.

    0.2's ``train.main`` takes the trainer class. The loss is what 0.2's ``train_step`` logs
    without data parallelism: ``torch.sum(torch.stack(microbatch_losses)).item()`` of the
    detached losses ``forward_backward_step`` returned."""
    import torch

    observer = StepObserver.from_env()

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
            if losses and observer.records_losses:
                # The reduction train_step applies before logging (1 rank: no all-reduce).
                observer.record_loss(self.step, torch.sum(torch.stack(losses)).item())
            return result

        def should_continue_training(self) -> bool:
            if observer.stop_here(self.step, tt_train.logger):
                return False
            return super().should_continue_training()

    return CpuTestTrainer
