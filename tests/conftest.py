"""Shared by every test folder: the test kits under tests/ become importable (``snapshot_kit``,
and the ``integration`` package it builds on, also for child processes started with
``PYTHONPATH`` set to this folder), and the fixtures that start real swap-state-server
processes on a temp Unix socket, with their segments in a private directory of /dev/shm,
torn down (SIGTERM, then SIGKILL) after each test."""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig  # noqa: E402


@pytest.fixture
def private_shm_dir():
    path = tempfile.mkdtemp(prefix="swap-state-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_server(private_shm_dir, tmp_path_factory):
    """``start_server(shm_size_bytes=..., grace_s=..., extra_args=(...))`` -> EmbeddedServer.

    Each server's snapshots go to a fresh temp directory (``snapshot_dir=`` to choose one),
    never to the per-user default of an embedded server. These servers stand for a host's:
    no watchdog restarts them (``auto_restart=True`` to have one); a test restarts one with
    ``server.restart()``."""
    started: list[EmbeddedServer] = []

    def start(**overrides) -> EmbeddedServer:
        config = EmbeddedServerConfig(
            shm_size_bytes=overrides.pop("shm_size_bytes", 256 << 20),
            grace_s=overrides.pop("grace_s", 30.0),
            shm_dir=overrides.pop("shm_dir", private_shm_dir),
            snapshot_dir=str(overrides.pop("snapshot_dir", None) or tmp_path_factory.mktemp("snapshots")),
            auto_restart=overrides.pop("auto_restart", False),
            **overrides,
        )
        server = EmbeddedServer(config).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint for the whole session: moto's server, a process on 127.0.0.1."""
    from store_kit import moto_endpoint

    with moto_endpoint() as url:
        yield url


@pytest.fixture
def s3_store(s3_endpoint, monkeypatch, request):
    """``s3://<fresh bucket>/snapshots`` on :func:`s3_endpoint`, with the AWS variables set in
    this process's environment (servers started afterwards inherit them)."""
    from store_kit import aws_env, create_bucket

    for name, value in aws_env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    bucket = "t-" + hex(abs(hash(request.node.nodeid)))[2:14]
    create_bucket(s3_endpoint, bucket)
    return f"s3://{bucket}/snapshots"


@pytest.fixture
def no_server_env(monkeypatch):
    monkeypatch.delenv("SWAP_STATE_SERVER", raising=False)
    monkeypatch.delenv("SWAP_STATE_JOB_ID", raising=False)
