"""Shared by every test folder: the test kits under tests/ become importable (``snapshot_kit``,
and the ``integration`` package it builds on, also for child processes started with
``PYTHONPATH`` set to this folder), and the fixtures that start real swap-state-server
processes on a temp Unix socket, with their segments in a private directory of /dev/shm,
torn down (SIGTERM, then SIGKILL) after each test.

CPU tests pin the CPU backend unless a test asks for a device: ``SWAP_STATE_DEVICE=cpu`` for
the session when it is unset, so that on a GPU machine the suite (and every server and trainer
process it starts, which inherit the environment) does not silently switch to CUDA. A run that
sets the variable keeps it (``scripts/gpu_check.sh`` sets ``cuda``). A test asks for a device
with the ``cuda`` or ``npu`` marker, or by living in a file named ``test_*_cuda.py`` /
``test_*_npu.py`` (its tests get the marker, so ``-m cuda`` selects them): for that test the
variable names the device and the process backend is chosen again; where the device is
absent the test is skipped, saying so."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig  # noqa: E402

#: client/device.py's DEVICE_ENV_VAR, spelled out: importing that module here would import torch
#: for the torch-free server tests too (tests/bench/test_gpu_probe.py checks they agree).
DEVICE_ENV_VAR = "SWAP_STATE_DEVICE"
#: The markers that ask for a device, and the file-name suffix that asks for one.
DEVICE_MARKERS = ("cuda", "npu")

os.environ.setdefault(DEVICE_ENV_VAR, "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests in ``test_*_cuda.py`` (``test_*_npu.py``) get the ``cuda`` (``npu``) marker."""
    for item in items:
        for device in DEVICE_MARKERS:
            if item.path.stem.endswith(f"_{device}"):
                item.add_marker(device)


@pytest.fixture(autouse=True)
def device_asked_for(request: pytest.FixtureRequest):
    """For a test marked ``cuda`` or ``npu``: the variable names that device and the process
    backend is chosen again on first use (both restored afterwards); a skip when it is absent."""
    asked = [name for name in DEVICE_MARKERS if request.node.get_closest_marker(name)]
    if not asked:
        yield None
        return
    from swap_state.client import device

    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")  # only where asked
    monkeypatch.setenv(DEVICE_ENV_VAR, asked[0])
    try:
        device.select_device_type()
    except RuntimeError as exc:
        pytest.skip(f"needs {asked[0]} (the test is marked {asked[0]}): {exc}")
    monkeypatch.setattr(device, "_BACKEND", None)
    yield asked[0]


@pytest.fixture
def private_shm_dir():
    path = tempfile.mkdtemp(prefix="swap-state-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_server(private_shm_dir, tmp_path_factory):
    """``start_server(shm_size_bytes=..., grace=..., persist_max_bandwidth="1M", ...)`` -> EmbeddedServer:
    the keywords of :class:`EmbeddedServerConfig` are its, any other is a server setting by its
    :class:`ServerConfig` name (a flag's text, such as ``"1M"``, or a value).

    Each server's snapshots go to a fresh temp directory (``snapshot_dir=`` to choose one),
    never to the per-user default of an embedded server. These servers stand for a host's:
    no watchdog restarts them (``auto_restart=True`` to have one); a test restarts one with
    ``server.restart()``."""
    started: list[EmbeddedServer] = []

    def start(**settings) -> EmbeddedServer:
        config = EmbeddedServerConfig(
            shm_size_bytes=settings.pop("shm_size_bytes", 256 << 20),
            snapshot_dir=str(settings.pop("snapshot_dir", None) or tmp_path_factory.mktemp("snapshots")),
            auto_restart=settings.pop("auto_restart", False),
            **{name: settings.pop(name) for name in ("start_timeout_s", "stop_timeout_s") if name in settings},
            server={"grace": 30.0, "shm_dir": private_shm_dir, **settings},
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
def no_server_env(monkeypatch, tmp_path_factory):
    """No server configured, and none at the default socket (an empty $XDG_RUNTIME_DIR): the
    trainer starts a private server, whatever runs on this host."""
    monkeypatch.delenv("SWAP_STATE_SERVER", raising=False)
    monkeypatch.delenv("SWAP_STATE_JOB_ID", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("runtime")))
