"""Integration fixtures: a real swap-state-server process on a temp Unix socket, with its
segments in a private directory of /dev/shm; torn down (SIGTERM, then SIGKILL) after each test."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest
import torch.distributed as dist

from swap_state.client.embedded import EmbeddedServer, EmbeddedServerConfig


@pytest.fixture
def private_shm_dir():
    path = tempfile.mkdtemp(prefix="swap-state-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_server(private_shm_dir, tmp_path_factory):
    """``start_server(shm_size_bytes=..., grace_s=..., extra_args=(...))`` -> EmbeddedServer.

    Each server's snapshots go to a fresh temp directory (``snapshot_dir=`` to choose one),
    never to the per-user default of an embedded server."""
    started: list[EmbeddedServer] = []

    def start(**overrides) -> EmbeddedServer:
        config = EmbeddedServerConfig(
            shm_size_bytes=overrides.pop("shm_size_bytes", 256 << 20),
            grace_s=overrides.pop("grace_s", 30.0),
            shm_dir=private_shm_dir,
            snapshot_dir=overrides.pop("snapshot_dir", None) or str(tmp_path_factory.mktemp("snapshots")),
            **overrides,
        )
        server = EmbeddedServer(config).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def server(start_server) -> EmbeddedServer:
    return start_server()


@pytest.fixture
def no_server_env(monkeypatch):
    monkeypatch.delenv("SWAP_STATE_SERVER", raising=False)
    monkeypatch.delenv("SWAP_STATE_JOB_ID", raising=False)


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
