"""Fixtures for the server tests: temporary shm and socket directories, in-process servers on a
temporary Unix socket, client channels, and server subprocesses. Teardown closes every channel,
stops every server and kills every process it started."""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

import grpc
import pytest

pathlib_here = pathlib.Path(__file__).resolve().parent
if str(pathlib_here) not in sys.path:  # for `import swap_server_testkit`
    sys.path.insert(0, str(pathlib_here))

from swap_server_testkit import ServerProcess  # noqa: E402

from swap_state.proto import swap_state_pb2_grpc as pb_grpc  # noqa: E402
from swap_state.server import ServerConfig, start_server  # noqa: E402
from swap_state.common.caller_proof import CallerProof  # noqa: E402
from swap_state.common.sizes import KiB, MiB  # noqa: E402


@pytest.fixture
def shm_dir() -> pathlib.Path:
    """A private directory on the real /dev/shm tmpfs (segments must live on a memory fs)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="sst-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sock_dir() -> pathlib.Path:
    # Short: a Unix socket path is limited to 107 bytes; pytest's tmp_path can be longer.
    path = pathlib.Path(tempfile.mkdtemp(prefix="ss-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_config(shm_dir, sock_dir):
    """ServerConfig factory with small, fast test defaults; keyword overrides win."""

    def make(**overrides) -> ServerConfig:
        values = dict(
            shm_size=64 * MiB,
            listen=f"unix://{sock_dir}/swap-state.sock",
            shm_dir=shm_dir,
            chunk_bytes=64 * KiB,
            cow_budget=512 * KiB,  # 8 slots
            grace=0.5,
            stream_wait=0.5,
            keepalive_interval=0.2,
            shutdown_grace=1.0,
        )
        values.update(overrides)
        return ServerConfig(**values)

    return make


@pytest.fixture
async def start(make_config):
    """``await start(**overrides)`` -> RunningServer; all are stopped at teardown."""
    servers = []

    async def _start(**overrides):
        running = await start_server(make_config(**overrides))
        servers.append(running)
        return running

    yield _start
    for running in servers:
        await running.stop(grace=0)


@pytest.fixture
async def server(start):
    return await start()


@pytest.fixture
async def connect():
    """``connect(server_or_address, token=None)`` -> SwapStateStub on a fresh aio channel,
    whose calls carry the token and, on a unix socket, this process's uid proof."""
    channels: list[grpc.aio.Channel] = []
    proofs: list[CallerProof] = []

    def _connect(target, token: str | None = None, options=(), prove: bool = True) -> pb_grpc.SwapStateStub:
        address = target if isinstance(target, str) else target.address
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if prove and address.startswith("unix:"):
            proof = CallerProof(address.removeprefix("unix://").removeprefix("unix:"))
            if proof.create():
                proofs.append(proof)
                metadata += (proof.metadata,)
        interceptors = [_MetadataUnary(metadata), _MetadataStream(metadata)] if metadata else None
        channel = grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
        channels.append(channel)
        stub = pb_grpc.SwapStateStub(channel)
        stub.channel = channel  # type: ignore[attr-defined]
        return stub

    yield _connect
    for channel in channels:
        await channel.close(grace=None)
    for proof in proofs:
        proof.remove()


@pytest.fixture
async def stub(server, connect):
    return connect(server)


class _Metadata:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)


# Two classes: grpc.aio files an interceptor under the first interceptor kind it matches.
class _MetadataUnary(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _MetadataStream(_Metadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


@pytest.fixture
def server_process(tmp_path):
    """``server_process(args, env=None)`` -> ServerProcess; killed at teardown if still alive."""
    procs: list[ServerProcess] = []

    def _spawn(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        proc = ServerProcess(args, tmp_path / f"server-{len(procs)}.log", env=env)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.kill()

