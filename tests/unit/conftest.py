"""Fixtures of the unit tests (no server, no accelerator needed)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# The helper module sits beside this file; keep it importable under any import mode.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def cpu_mesh() -> DeviceMesh:
    """A 1-rank gloo mesh; the process group is created once, on a free port."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return DeviceMesh("cpu", [0])
