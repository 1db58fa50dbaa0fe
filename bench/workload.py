"""The training workload every measurement runs: a stack of square Linear layers sized to a
parameter count, three optimizers over identical copies of it, and a timed step loop.

Variants (same model, same data, same AdamW hyperparameters):

* ``plain``: ``torch.optim.AdamW(fused=True)``, moments resident on the device;
* ``inproc``: :class:`swap_state.client.swap_optimizer.SwapOptimizersContainer`
  (moments in process-local host memory, pinned where an accelerator exists);
* ``remote``: :class:`swap_state.client.remote.container.RemoteSwapOptimizersContainer`
  (moments in the swap-state-server's shared memory, the step committed through a header word).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from bench.util import proc_status

__all__ = ["RpcCounter", "Variant", "build_model", "build_variant", "model_shape", "timed_steps"]

VARIANTS = ("plain", "inproc", "remote")
ADAMW_KWARGS = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def model_shape(params: int) -> tuple[int, int]:
    """(width, layers) of a stack of bias-free ``width x width`` Linears with ~``params``
    parameters: the widest of 2048..64 that still gives at least 4 layers."""
    for width in (2048, 1024, 512, 256, 128, 64):
        if params >= 4 * width * width:
            break
    return width, max(1, round(params / (width * width)))


class Stack(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        for layer in self.layers:
            # He init keeps activations O(1) through the ReLU stack, so gradients and Adam
            # moments stay well inside the normal float range (denormals would slow the CPU
            # update by an order of magnitude and measure the workload, not the optimizer).
            nn.init.normal_(layer.weight, std=(2.0 / width) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build_model(params: int, device: torch.device, seed: int = 0) -> nn.Module:
    width, layers = model_shape(params)
    torch.manual_seed(seed)
    return Stack(width, layers).to(device)


class RpcCounter:
    """Counts every unary RPC of a :class:`SwapStateClient` by name and times CommitStep.

    Wraps the client instance's ``call`` (the one path every unary RPC takes); the
    KeepAlive stream is not a unary call and is not counted."""

    def __init__(self, client: Any):
        self.counts: Counter[str] = Counter()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.enabled = True
        original = client.call

        def call(name: str, request: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(name, request, timeout_s, **kwargs)
            finally:
                if self.enabled:
                    self.counts[name] += 1
                    self.latency[name].append(time.perf_counter() - t0)

        client.call = call

    def reset(self) -> None:
        self.counts.clear()
        self.latency.clear()


@dataclasses.dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: Any
    x: torch.Tensor
    sync: Callable[[], None]
    rss_delta: dict[str, int] = dataclasses.field(default_factory=dict)
    rpc: RpcCounter | None = None

    def step(self) -> tuple[float, float]:
        """One training step; (train step seconds, optimizer step seconds)."""
        self.sync()
        t0 = time.perf_counter()
        self.model(self.x).square().mean().backward()
        self.sync()
        t1 = time.perf_counter()
        self.optimizer.step()
        self.sync()
        t2 = time.perf_counter()
        self.optimizer.zero_grad()
        self.sync()
        t3 = time.perf_counter()
        return t3 - t0, t2 - t1

    def close(self) -> None:
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()


def remote_container(model: nn.Module, device: torch.device, swap_times: int, server: str | None,
                     job_id: str | None):
    """The remote container of ``model`` (AdamW as every variant), no step taken."""
    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer

    return RemoteSwapOptimizersContainer([model], torch.optim.AdamW, dict(ADAMW_KWARGS), swap_times, server=server,
                                         job_id=job_id, config=RemoteConfig(rpc_timeout_s=60.0),
                                         **_device_backend(device))


def _device_backend(device: torch.device) -> dict[str, Any]:
    """The CPU section stays on the CPU even where a GPU exists (the containers would pick it)."""
    from swap_state.client.device import DeviceBackend

    return {"device_backend": DeviceBackend("cpu")} if device.type == "cpu" else {}


def build_variant(
    name: str,
    base: nn.Module,
    batch: int,
    device: torch.device,
    swap_times: int,
    server: str | None = None,
    job_id: str | None = None,
) -> Variant:
    """A copy of ``base`` with the ``name`` optimizer; its state is allocated (one step
    taken), and ``rss_delta`` says how the trainer's RSS grew from building the optimizer
    and its first ``step()`` (gradients already exist): the optimizer state, as far as the
    allocator hands out fresh pages (it may also reuse memory freed earlier)."""
    from swap_state.client.swap_optimizer import SwapOptimizersContainer

    model = copy.deepcopy(base)
    width = model.layers[0].in_features
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Gradients first, so that the RSS growth below is the optimizer state alone.
    model(x).square().mean().backward()
    sync()
    before = proc_status()
    kwargs = dict(ADAMW_KWARGS)
    if name == "plain":
        optimizer: Any = torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
    elif name == "inproc":
        optimizer = SwapOptimizersContainer([model], torch.optim.AdamW, kwargs, swap_times, **_device_backend(device))
    elif name == "remote":
        optimizer = remote_container(model, device, swap_times, server, job_id)
    else:
        raise ValueError(name)
    optimizer.step()  # plain AdamW allocates its moments lazily, on the first step
    sync()
    after = proc_status()
    optimizer.zero_grad()
    variant = Variant(name, model, optimizer, x, sync)
    variant.rss_delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("RssAnon", "RssShmem", "VmRSS")}
    if name == "remote":
        variant.rpc = RpcCounter(optimizer.client)
    return variant


def timed_steps(variants: list[Variant], steps: int, warmup: int, block: int) -> dict[str, dict[str, list[float]]]:
    """Interleaved: rounds of ``block`` steps per variant, the order rotating every round,
    so that drift on a shared machine hits every variant alike."""
    for variant in variants:
        for _ in range(warmup):
            variant.step()
    for variant in variants:
        if variant.rpc is not None:
            variant.rpc.reset()
    out = {v.name: {"train": [], "opt": []} for v in variants}
    done = 0
    round_index = 0
    while done < steps:
        n = min(block, steps - done)
        order = variants[round_index % len(variants):] + variants[: round_index % len(variants)]
        for variant in order:
            for _ in range(n):
                train, opt = variant.step()
                out[variant.name]["train"].append(train)
                out[variant.name]["opt"].append(opt)
        done += n
        round_index += 1
    return out
