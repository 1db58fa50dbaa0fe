"""Integration fixtures: one started server per test (``start_server`` is tests/conftest.py's,
shared with the torchtitan tests), the segment files of a shm directory, a gloo group."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist

from swap_state.client.remote.embedded import EmbeddedServer


@pytest.fixture
def server(start_server) -> EmbeddedServer:
    return start_server()


def shm_files(path: str) -> set[str]:
    return set(os.listdir(path))


@pytest.fixture
def gloo_one_rank():
    """A 1-rank gloo process group on a free port (reused if the process already has one)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
