"""Helpers of the snapshot integration tests: a model whose moments span several chunks, a
step-N record of the host cache, the safetensors file of a durable snapshot, a tiny tmpfs,
and the ``swap-state`` command line. The training loop and the torch reference are
:mod:`.workload`'s."""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from .workload import Workload, kwargs, train

#: Chunk size the servers of these tests use: a multiple of the page size, far below the
#: default, so one moment tensor of :class:`WideNet` is several chunks.
CHUNK = 64 << 10
#: The ``swap-state`` command (pyproject's [project.scripts] points it at this module's main;
#: run through the interpreter so a stale console-script shim cannot stand in for it).
SWAP_STATE_CLI = (sys.executable, "-m", "swap_state.client.cli")


class WideNet(nn.Module):
    """Same input as :class:`.workload.Net` (so :func:`.workload.train` drives it); its middle
    weight is 256 KiB, i.e. 4 chunks of :data:`CHUNK` per moment."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 256)
        self.mid = nn.Linear(256, 256)
        self.head = nn.Linear(256, 6)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.body(x)))))


def build_wide(w: Workload) -> WideNet:
    torch.manual_seed(w.seed)
    return WideNet()


def moment_bytes(model: nn.Module) -> int:
    """Bytes of exp_avg + exp_avg_sq of every parameter."""
    return sum(2 * p.numel() * p.element_size() for p in model.parameters())


def reference(w: Workload, builder, steps: int):
    """An uninterrupted torch fused AdamW run of ``steps`` steps: (model, optimizer)."""
    model = builder(w)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **kwargs(w))
    train(model, optimizer, w, range(1, steps + 1))
    return model, optimizer


def record_state(model: nn.Module, container) -> dict[str, torch.Tensor]:
    """Copies of the host cache now, under the segment's tensor names (``state.<fqn>.<key>``),
    plus the per-parameter steps in update order (``swap_state.param_steps``)."""
    out: dict[str, torch.Tensor] = {}
    steps = []
    for name, param in model.named_parameters():
        host = container.param_to_cpu_states_map[param]
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if host.get(key) is not None:
                out[f"state.{name}.{key}"] = host[key].clone()
        steps.append(float(host["step"]))
    out["swap_state.param_steps"] = torch.tensor(steps, dtype=torch.float32)
    return out


def params_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def bitwise_diff(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """Keys of ``expected`` missing from ``actual`` or not bitwise equal there."""
    return [
        k
        for k, v in expected.items()
        if k not in actual
        or actual[k].dtype != v.dtype
        or actual[k].shape != v.shape
        or not torch.equal(actual[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    ]


def data_file(status_path: str, rank: int = 0) -> pathlib.Path:
    return pathlib.Path(status_path) / f"rank-{rank:05d}.safetensors"


def rank_manifest(status_path: str, rank: int = 0) -> dict:
    return json.loads((pathlib.Path(status_path) / f"rank-{rank:05d}.manifest.json").read_text())


def flip_byte_of_tensor(path: pathlib.Path, tensor: str, at: int = 5) -> None:
    """Flip one bit of byte ``at`` of ``tensor``'s data in a safetensors file, found through
    the file's own header (8-byte little-endian length, JSON, then the data)."""
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    begin, end = header[tensor]["data_offsets"]
    assert at < end - begin
    raw[8 + header_len + begin + at] ^= 0x10
    path.write_bytes(bytes(raw))


@contextlib.contextmanager
def tiny_tmpfs(path: pathlib.Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` for the block; skips when mount is refused."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def swap_state_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``swap-state ARGS`` in a process of its own."""
    return subprocess.run([*SWAP_STATE_CLI, *args], capture_output=True, text=True, timeout=timeout)


__all__ = [
    "CHUNK",
    "SWAP_STATE_CLI",
    "WideNet",
    "build_wide",
    "moment_bytes",
    "reference",
    "record_state",
    "params_copy",
    "bitwise_diff",
    "data_file",
    "rank_manifest",
    "flip_byte_of_tensor",
    "tiny_tmpfs",
    "swap_state_cli",
]
