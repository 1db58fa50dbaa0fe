"""The first contact with an accelerator: one JSON line per figure, nothing else.

``bash scripts/gpu_check.sh`` runs it on a lent machine (``python -m bench.gpu_probe --device
cuda``); ``--small --device cpu`` runs every figure here, at toy sizes, which is how the tests
check the logic without CUDA. Each figure is one function of a :class:`Probe` (the backend, the
sizes, a device-memory meter) returning a dict; :func:`run_figures` prints
``{"figure": name, "device": ..., "seconds": ..., **values}`` or, when the figure raised or ran
past its deadline, ``{"figure": name, "device": ..., "seconds": ..., "error": "..."}`` and goes
on with the next one: a session has 15 minutes of device time in all, so one broken figure
must cost its own deadline and no more.

Figures: the environment; the time to register a /dev/shm segment (one registration, and in
chunks); H2D / D2H bandwidth from that registered mapping (both ways of registering) against
``pin_memory``; the peak device memory of one optimizer step over the moments' bytes, for the
in-process and the remote container; bitwise equality of N steps of both containers with
``torch.optim.AdamW(fused=True)``; step time while a snapshot persists (remote container,
whole-state snapshots, embedded server); the parameter fingerprint at a 14336x4096 shape.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import mmap
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import torch
from swap_state.client.device import DeviceBackend, select_device_type
from torch import nn

from bench.cuda import shm_tensor
from bench.report import _finite
from bench.util import gbps, summarize
from bench.workload import build_model, model_shape

__all__ = [
    "FIGURES",
    "FULL",
    "SMALL",
    "DeviceMemory",
    "FigureTimeout",
    "Probe",
    "Sizes",
    "main",
    "run_figures",
]

# The hyperparameters of the CUDA parity test (tests/integration/test_whole_state_cuda.py).
ADAMW: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": True}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each figure is; :data:`FULL` on the lent machine, :data:`SMALL` for tests."""

    shm_bytes: int
    chunk_bytes: int
    copy_reps: int
    params: int
    swap_times: int
    batch: int
    parity_steps: int
    snapshot_params: int
    snapshot_steps: int
    snapshot_max_s: float
    fingerprint_shape: tuple[int, int]
    fingerprint_reps: int


# 2 GiB keeps registration and copies well above driver overheads and within the machine's
# /dev/shm; 128M params is 1 GiB of moments, 8 slices of 128 MiB, so a step that holds every
# slice at once stands out clearly from one that holds three.
FULL = Sizes(
    shm_bytes=2 << 30, chunk_bytes=256 << 20, copy_reps=5, params=128 << 20, swap_times=8, batch=32,
    parity_steps=5, snapshot_params=32 << 20, snapshot_steps=20, snapshot_max_s=45.0,
    fingerprint_shape=(14336, 4096), fingerprint_reps=20,
)  # fmt: skip
SMALL = Sizes(
    shm_bytes=4 * mmap.PAGESIZE, chunk_bytes=mmap.PAGESIZE, copy_reps=2, params=1 << 14, swap_times=2,
    batch=4, parity_steps=2, snapshot_params=1 << 14, snapshot_steps=2, snapshot_max_s=20.0,
    fingerprint_shape=(143, 41), fingerprint_reps=2,
)  # fmt: skip


class DeviceMemory:
    """Current and peak bytes of the backend's caching allocator (``torch.cuda`` and
    ``torch.npu`` share these calls); every reading is None on CPU, which has no such counter."""

    def __init__(self, backend: DeviceBackend) -> None:
        self._module = backend.module if backend.is_accelerator else None

    def reset_peak(self) -> None:
        """Start a new peak from what is allocated now."""
        if self._module is not None:
            self._module.synchronize()
            self._module.reset_peak_memory_stats()

    def allocated(self) -> int | None:
        """Bytes allocated now."""
        return None if self._module is None else int(self._module.memory_allocated())

    def peak(self) -> int | None:
        """Most bytes allocated at once since :meth:`reset_peak`."""
        return None if self._module is None else int(self._module.max_memory_allocated())


@dataclasses.dataclass
class Probe:
    """What every figure gets: the backend it measures, the sizes, where it may write."""

    backend: DeviceBackend
    sizes: Sizes
    work_dir: str
    shm_dir: str = "/dev/shm"
    memory: DeviceMemory | None = None

    def __post_init__(self) -> None:
        if self.memory is None:
            self.memory = DeviceMemory(self.backend)

    @property
    def device(self) -> torch.device:
        """Where the model and the device buffers go."""
        return self.backend.current_device()


class FigureTimeout(Exception):
    """A figure ran past its deadline (raised in the main thread by SIGALRM)."""


# -- host memory ------------------------------------------------------------------------------------
def _chunked(backend: DeviceBackend, chunk_bytes: int) -> DeviceBackend:
    """The same kind of backend (a test's subclass included), registering in ``chunk_bytes``."""
    return type(backend)(backend.type, backend.module, chunk_bytes=chunk_bytes)


def _registration(backend: DeviceBackend, host: torch.Tensor) -> dict[str, Any]:
    t0 = time.perf_counter()
    registration = backend.register_host_memory(host.data_ptr(), host.numel())
    t1 = time.perf_counter()
    backend.unregister_host_memory(registration.ptr)
    t2 = time.perf_counter()
    return {"chunks": len(registration.chunks), "register_s": t1 - t0, "unregister_s": t2 - t1,
            "register_gib_per_s": host.numel() / (1 << 30) / (t1 - t0) if t1 > t0 else None}  # fmt: skip


def register_shm(p: Probe) -> dict[str, Any]:
    """Time to register (and unregister) a /dev/shm segment: one call, then in chunks."""
    with shm_tensor(p.sizes.shm_bytes, p.shm_dir) as host:
        host.fill_(1)  # fault every page in first: registering then measures the pinning alone
        one = _registration(p.backend, host)
        chunked = _registration(_chunked(p.backend, p.sizes.chunk_bytes), host)
        nbytes = host.numel()
        del host
    return {"bytes": nbytes, "one_registration": one, "chunked": {"chunk_bytes": p.sizes.chunk_bytes, **chunked}}


def _trim(summary: dict[str, float]) -> dict[str, float]:
    """The keys of a :func:`bench.util.summarize` a JSON line needs: one line stays readable."""
    return {k: summary[k] for k in ("n", "median", "p10", "p90", "max") if k in summary}


def _brief(samples: Sequence[float]) -> dict[str, float]:
    return _trim(summarize(samples))


def _copy_gbps(backend: DeviceBackend, dst: torch.Tensor, src: torch.Tensor, reps: int) -> dict[str, float]:
    dst.copy_(src, non_blocking=True)  # warm-up: first touch and the driver's first path
    backend.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        backend.synchronize()
        samples.append(gbps(src.numel() * src.element_size(), time.perf_counter() - t0))
    return _brief(samples)


def _both_ways(backend: DeviceBackend, host: torch.Tensor, on_device: torch.Tensor, reps: int) -> dict[str, Any]:
    return {"h2d_gbps": _copy_gbps(backend, on_device, host, reps),
            "d2h_gbps": _copy_gbps(backend, host, on_device, reps)}  # fmt: skip


def copy_bandwidth(p: Probe) -> dict[str, Any]:
    """H2D and D2H GB/s between the device and: a /dev/shm mapping registered in one call, the
    same mapping registered in chunks, and ``pin_memory`` (what the in-process container uses)."""
    reps = p.sizes.copy_reps
    out: dict[str, Any] = {"pinned": p.backend.pin_memory_available, "chunk_bytes": p.sizes.chunk_bytes}
    with shm_tensor(p.sizes.shm_bytes, p.shm_dir) as host:
        host.fill_(1)
        out["bytes"] = host.numel()
        on_device = torch.empty_like(host, device=p.device)
        for name, backend in (("shm_one_registration", p.backend),
                              ("shm_chunked", _chunked(p.backend, p.sizes.chunk_bytes))):  # fmt: skip
            registration = backend.register_host_memory(host.data_ptr(), host.numel())
            try:
                # torch must see the range as pinned, or its non_blocking copies are synchronous.
                out[name] = {"seen_as_pinned": host.is_pinned(), **_both_ways(p.backend, host, on_device, reps)}
            finally:
                p.backend.synchronize()  # no copy may still read the range being unregistered
                backend.unregister_host_memory(registration.ptr)
        del host
    pinned = torch.ones(out["bytes"], dtype=torch.uint8, pin_memory=p.backend.pin_memory_available)
    out["pin_memory"] = _both_ways(p.backend, pinned, on_device, reps)
    del pinned, on_device
    p.backend.empty_cache()
    return out


# -- containers ------------------------------------------------------------------------------------------
def _remote(p: Probe, model: nn.Module, swap_times: int, **config: Any) -> Any:
    """A remote container on an embedded server of its own (snapshots under the work dir)."""
    from swap_state.client.remote.container import (
        RemoteConfig,
        RemoteSwapOptimizersContainer,
    )
    from swap_state.client.remote.embedded import EmbeddedServerConfig

    embedded = EmbeddedServerConfig(snapshot_dir=os.path.join(p.work_dir, "snapshots"), server={"shm_dir": p.shm_dir},
                                    auto_restart=False)  # fmt: skip
    return RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, dict(ADAMW), swap_times, job_id=f"probe-{uuid.uuid4().hex[:8]}",
        config=RemoteConfig(embedded=embedded, rpc_timeout_s=60.0, **config), device_backend=p.backend,
    )  # fmt: skip


def _container(p: Probe, kind: str, model: nn.Module, swap_times: int) -> Any:
    if kind == "remote":
        return _remote(p, model, swap_times)
    from swap_state.client.swap_optimizer import SwapOptimizersContainer

    return SwapOptimizersContainer([model], torch.optim.AdamW, dict(ADAMW), swap_times, device_backend=p.backend)


def _input(p: Probe, params: int, batch: int, seed: int) -> torch.Tensor:
    width, _ = model_shape(params)
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(seed)).to(p.device)


def _peak_memory(p: Probe, kind: str) -> dict[str, Any]:
    s = p.sizes
    model = build_model(s.params, p.device)
    x = _input(p, s.params, s.batch, 1)
    optimizer = _container(p, kind, model, s.swap_times)
    try:
        for _ in range(2):  # the first step allocates what every step reuses; the second is measured
            model(x).square().mean().backward()
            p.backend.synchronize()
            p.memory.reset_peak()
            before = p.memory.allocated()
            optimizer.step()
            p.backend.synchronize()
            peak = p.memory.peak()
            optimizer.zero_grad()
    finally:
        close = getattr(optimizer, "close", None)
        if close is not None:
            close()
    params = sum(t.numel() for t in model.parameters())
    moments = 2 * 4 * params  # fp32 exp_avg and exp_avg_sq
    step_bytes = None if peak is None or before is None else peak - before
    return {"params": params, "moments_bytes": moments, "swap_times": s.swap_times,
            "slice_bytes": moments // s.swap_times, "step_peak_bytes": step_bytes,
            "peak_over_moments": None if step_bytes is None else step_bytes / moments,
            "peak_over_slice": None if step_bytes is None else step_bytes / (moments / s.swap_times)}  # fmt: skip


def peak_memory_inproc(p: Probe) -> dict[str, Any]:
    """Device memory one step of the in-process container adds at its peak, over the moments."""
    return _peak_memory(p, "inproc")


def peak_memory_remote(p: Probe) -> dict[str, Any]:
    """The same for the remote container (moments in an embedded server's segment)."""
    return _peak_memory(p, "remote")


def _train(p: Probe, model: nn.Module, optimizer: Any, steps: int, params: int, batch: int) -> None:
    for step in range(1, steps + 1):
        model(_input(p, params, batch, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    p.backend.synchronize()


def parity_fused_adamw(p: Probe) -> dict[str, Any]:
    """N steps of each container against ``torch.optim.AdamW(fused=True)`` on the same device
    and data: the parameters must be equal bit for bit."""
    s = p.sizes
    params = min(s.params, 1 << 22)  # parity needs no size; a small model keeps it quick
    reference = build_model(params, p.device)
    _train(p, reference, torch.optim.AdamW(reference.parameters(), **ADAMW), s.parity_steps, params, s.batch)
    out: dict[str, Any] = {"steps": s.parity_steps, "params": params}
    for kind in ("inproc", "remote"):
        model = build_model(params, p.device)
        optimizer = _container(p, kind, model, s.swap_times)
        try:
            _train(p, model, optimizer, s.parity_steps, params, s.batch)
        finally:
            if kind == "remote":
                optimizer.close()
        with torch.no_grad():
            pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
            out[kind] = {"bitwise_equal": all(torch.equal(a, b) for a, b in pairs),
                         "max_abs_diff": max(float((a - b).abs().max()) for a, b in pairs)}  # fmt: skip
    return out


def step_while_snapshot(p: Probe) -> dict[str, Any]:
    """Step times while a whole-state snapshot persists against without (remote container,
    embedded server), through the benchmark's own measurement (:func:`bench.measure.snapshot_overlap`)."""
    from bench.measure import snapshot_overlap
    from bench.workload import Variant

    s = p.sizes
    model = build_model(s.snapshot_params, p.device)
    x = _input(p, s.snapshot_params, s.batch, 1)
    optimizer = _remote(p, model, s.swap_times, checkpoint="snapshot")
    try:
        variant = Variant("remote", model, optimizer, x, p.backend.synchronize)
        variant.step()  # the first step allocates
        result = snapshot_overlap(variant, s.snapshot_steps, s.snapshot_max_s)
    finally:
        optimizer.close()
    keep = ("snapshots", "steps_with", "steps_without", "snapshot_call_s", "with_opt_s", "without_opt_s",
            "ratio_opt", "ratio_train", "snapshot_to_durable_while_training_s", "cow_copies",
            "backpressure_waits", "trainer_copied_bytes", "server_staged_bytes")  # fmt: skip
    values = {k: _trim(v) if isinstance(v, dict) and "median" in v else v for k, v in ((k, result[k]) for k in keep)}
    return {"params": sum(t.numel() for t in model.parameters()), **values}


def fingerprint(p: Probe) -> dict[str, Any]:
    """:class:`ParamFingerprint` of one bf16 parameter of a real LLM shape: its time, and that
    the device computes the value the host computes from the same bytes."""
    from swap_state.client.remote.remote_segment import ParamFingerprint, sample_stride

    torch.manual_seed(0)
    param = torch.randn(p.sizes.fingerprint_shape, dtype=torch.bfloat16, device=p.device)
    fp = ParamFingerprint([param])
    t0 = time.perf_counter()
    value = fp.compute()
    first = time.perf_counter() - t0
    times = []
    for _ in range(p.sizes.fingerprint_reps):
        t0 = time.perf_counter()
        fp.compute()
        times.append(time.perf_counter() - t0)
    samples, stride = sample_stride(param.numel())
    host_value = ParamFingerprint([param.cpu()]).compute()
    return {"shape": list(param.shape), "dtype": str(param.dtype), "samples": samples,
            "last_sample_index": (samples - 1) * stride, "numel": param.numel(), "first_compute_s": first,
            "compute_s": _brief(times), "matches_host": value == host_value}  # fmt: skip


def environment(p: Probe) -> dict[str, Any]:
    """What the figures ran on."""
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "sizes": dataclasses.asdict(p.sizes)}  # fmt: skip
    if p.backend.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name()
        out["device_memory_bytes"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    with contextlib.suppress(ImportError):
        import google.protobuf
        import grpc

        out["grpcio"], out["protobuf"] = grpc.__version__, google.protobuf.__version__
    out["dev_shm_free_bytes"] = shutil.disk_usage(p.shm_dir).free
    return out


FIGURES: dict[str, Callable[[Probe], dict[str, Any]]] = {
    "environment": environment,
    "register_shm": register_shm,
    "copy_bandwidth": copy_bandwidth,
    "peak_memory_inproc": peak_memory_inproc,
    "peak_memory_remote": peak_memory_remote,
    "parity_fused_adamw": parity_fused_adamw,
    "step_while_snapshot": step_while_snapshot,
    "fingerprint": fingerprint,
}


# -- the driver ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`FigureTimeout` in this (main) thread after ``seconds``. A call stuck in C
    (a device sync) is interrupted only when it returns; the script's ``timeout`` covers that."""

    def expire(signum: int, frame: Any) -> None:
        raise FigureTimeout(f"ran past its {seconds:g} s deadline")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_figures(probe: Probe, names: Sequence[str], timeout_s: float, out: TextIO | None = None) -> int:
    """Print one JSON line per figure of ``names`` (to ``out``, else stdout), in order; return
    how many failed."""
    out = out or sys.stdout  # looked up now: a caller may have replaced sys.stdout
    failed = 0
    for name in names:
        line: dict[str, Any] = {"figure": name, "device": probe.backend.type}
        t0 = time.perf_counter()
        try:
            with _deadline(timeout_s):
                line.update(FIGURES[name](probe))
        except Exception as exc:  # noqa: BLE001 - the next figure still runs: say what broke, go on
            failed += 1
            line["error"] = f"{type(exc).__name__}: {exc}"
        line["seconds"] = round(time.perf_counter() - t0, 3)
        out.write(json.dumps(_finite(line), default=str, allow_nan=False) + "\n")
        out.flush()
        gc.collect()  # each figure's tensors and containers go before the next one measures
        with contextlib.suppress(Exception):  # a device left broken by a figure fails the next on its own
            probe.backend.empty_cache()
    return failed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), default=None,
                        help="the backend to measure (default: $SWAP_STATE_DEVICE, else the first present)")
    parser.add_argument("--small", action="store_true", help="toy sizes (the CPU tests use them)")
    parser.add_argument("--only", action="append", choices=sorted(FIGURES), help="run only these figures")
    parser.add_argument("--figure-timeout", type=float, default=90.0, help="seconds one figure may take")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the shared-memory mappings go")
    return parser  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the figures; exit status 1 when any failed."""
    args = _parser().parse_args(argv)
    backend = DeviceBackend(args.device or select_device_type())
    work_dir = tempfile.mkdtemp(prefix="swap-state-probe-")
    try:
        probe = Probe(backend, SMALL if args.small else FULL, work_dir, args.shm_dir)
        names = args.only or list(FIGURES)
        return 1 if run_figures(probe, names, args.figure_timeout) else 0
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
