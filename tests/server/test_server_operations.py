"""Operations: token auth, health, Prometheus metrics, structured logs."""

from __future__ import annotations

import os
import asyncio
import logging
import pathlib
import re
import shutil
import socket
import subprocess
import time

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from swap_server_testkit import Trainer, spec

from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc
from swap_state.common.errors import StartupError
from swap_state.server.logs import LogfmtFormatter, log_event


async def test_token_is_required_except_for_health(start, connect, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    server = await start(token_file=token_file)

    for stub in (connect(server), connect(server, token="wrong")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Attach(pb.AttachRequest(job_id="j", rank=0, world_size=1), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.KeepAlive(pb.KeepAliveRequest(session_id="0" * 32, generation=1)).read()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Stats(pb.StatsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    good = Trainer(connect(server, token="s3cret-token"))
    await good.attach()
    await good.keep_alive()
    await good.allocate([spec("m", (16,))])
    await good.commit(0)

    channel = grpc.aio.insecure_channel(server.address)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close()
    good.close()


async def test_health_reports_serving_for_the_service_then_not_serving(start):
    server = await start()
    channel = grpc.aio.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(service="swap_state.v1.SwapState"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.create_task(server.stop(grace=0.5))
        assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping
    finally:
        await channel.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _http_get(port: int, path: str) -> tuple[str, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return head, body


_SAMPLE = re.compile(r'^[a-z_:][a-z0-9_:]*(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? [-+0-9.eEInfNa]+$')
_LABEL = re.compile(r'([a-z_]+)="((?:[^"\\]|\\.)*)"')


def _samples(lines: list[str]) -> dict[tuple[str, frozenset], float]:
    """``{(name, frozenset(labels)): value}``: label order and number spelling (``3``,
    ``3.0``, ``3e+00``) are the exposition's business, not the metric's."""
    samples = {}
    for line in lines:
        if line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        samples[(name, frozenset(_LABEL.findall(labels)))] = float(value)
    return samples


def _sample(samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_metrics_endpoint_serves_prometheus_text(start, connect):
    server = await start(metrics_port=_free_port(), metrics_host="127.0.0.1")
    port = server.metrics_address[1]
    trainer = Trainer(connect(server), 'job"with-quote'.replace('"', ""), rank=2, world_size=4)
    await trainer.attach()
    await trainer.keep_alive()
    seg = (await trainer.allocate([spec("m", (1000,))])).segment
    for step in range(3):
        await trainer.commit(step)
    with pytest.raises(grpc.aio.AioRpcError):
        await trainer.commit(0)

    head, body = await _http_get(port, "/metrics")
    assert head.startswith("HTTP/1.1 200") and "text/plain; version=0.0.4" in head
    lines = body.splitlines()
    for line in lines:
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or _SAMPLE.match(line), line
    samples = _samples(lines)
    assert _sample(samples, "swap_state_budget_used_bytes") == os.stat(seg.path).st_size
    assert _sample(samples, "swap_state_steps_committed_total") == 3
    assert _sample(samples, "swap_state_sessions", state="live") == 1
    assert _sample(samples, "swap_state_session_last_committed_step", job_id="jobwith-quote",
                   rank="2") == 2
    assert _sample(samples, "swap_state_rpc_total", method="CommitStep", code="OK") == 3
    assert _sample(samples, "swap_state_rpc_total", method="CommitStep",
                   code="FAILED_PRECONDITION") == 1

    head, _ = await _http_get(port, "/nope")
    assert head.startswith("HTTP/1.1 404")
    trainer.close()


# The families /metrics served before the move to prometheus_client (hand-rendered then):
# (name, type, label names), in order. Scrapers and dashboards depend on these names.
_FAMILIES = [
    ("swap_state_up", "gauge", ()),
    ("swap_state_start_time_seconds", "gauge", ()),
    ("swap_state_budget_total_bytes", "gauge", ()),
    ("swap_state_budget_used_bytes", "gauge", ()),
    ("swap_state_budget_free_bytes", "gauge", ()),
    ("swap_state_cow_pool_slots", "gauge", ()),
    ("swap_state_cow_pool_slots_used", "gauge", ()),
    ("swap_state_segment_allocations_total", "counter", ()),
    ("swap_state_segment_allocation_failures_total", "counter", ()),
    ("swap_state_mlock_failures_total", "counter", ()),
    ("swap_state_sessions", "gauge", ("state",)),
    ("swap_state_session_segment_bytes", "gauge", ("job_id", "rank")),
    ("swap_state_session_model_area_bytes", "gauge", ("job_id", "rank")),
    ("swap_state_session_last_committed_step", "gauge", ("job_id", "rank")),
    ("swap_state_session_generation", "gauge", ("job_id", "rank")),
    ("swap_state_steps_committed_total", "counter", ()),
    ("swap_state_kept_states_dropped_total", "counter", ()),
    ("swap_state_attaches_total", "counter", ()),
    ("swap_state_reattaches_total", "counter", ()),
    ("swap_state_sessions_freed_total", "counter", ()),
    ("swap_state_sessions_expired_total", "counter", ()),
    ("swap_state_sessions_adopted_total", "counter", ()),
    ("swap_state_session_reconnects_total", "counter", ()),
    ("swap_state_rpc_total", "counter", ("code", "method")),
    ("swap_state_rpc_seconds_total", "counter", ("method",)),
    ("swap_state_snapshots_in_progress", "gauge", ()),
    ("swap_state_snapshots_started_total", "counter", ()),
    ("swap_state_snapshots_durable_total", "counter", ()),
    ("swap_state_snapshots_failed_total", "counter", ()),
    ("swap_state_snapshot_bytes_total", "counter", ()),
    ("swap_state_snapshot_cow_copies_total", "counter", ()),
    ("swap_state_snapshot_backpressure_waits_total", "counter", ()),
    ("swap_state_snapshot_backpressure_wait_seconds_total", "counter", ()),
]


async def test_metrics_keep_their_names_types_and_labels(start, connect, tmp_path):
    server = await start(metrics_port=_free_port(), metrics_host="127.0.0.1",
                         snapshot_dir=tmp_path / "snapshots")
    trainer = Trainer(connect(server), "names", rank=0, world_size=1)
    await trainer.attach()
    await trainer.keep_alive()
    await trainer.allocate([spec("m", (16,))])
    await trainer.commit(0)

    head, body = await _http_get(server.metrics_address[1], "/metrics")
    assert head.startswith("HTTP/1.1 200")
    lines = body.splitlines()
    types = [tuple(line.split(" ")[2:4]) for line in lines if line.startswith("# TYPE ")]
    helps = [line.split(" ")[2] for line in lines if line.startswith("# HELP ")]
    assert types == [(name, kind) for name, kind, _ in _FAMILIES]
    assert helps == [name for name, _, _ in _FAMILIES]
    labels: dict[str, set[tuple[str, ...]]] = {}
    for (name, pairs), _ in _samples(lines).items():
        labels.setdefault(name, set()).add(tuple(sorted(key for key, _ in pairs)))
    # Every family has samples here, each with exactly its label names (no _created series).
    assert labels == {name: {names} for name, _, names in _FAMILIES}
    # A private registry: nothing lands in prometheus_client's process-global one.
    assert b"swap_state_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
    trainer.close()


def test_log_lines_are_one_line_logfmt():
    record_logger = logging.getLogger("swap_state.test.logfmt")
    lines = []

    class Capture(logging.Handler):
        def emit(self, record):
            lines.append(LogfmtFormatter().format(record))

    handler = Capture()
    record_logger.addHandler(handler)
    record_logger.setLevel(logging.INFO)
    try:
        log_event(record_logger, "session_attached", job_id="a b", host='evil"\nline', rank=3,
                  ok=True)
    finally:
        record_logger.removeHandler(handler)
    (line,) = lines
    assert "\n" not in line
    assert 'event=session_attached job_id="a b" host="evil\\"\\nline" rank=3 ok=true' in line
    assert re.match(r"ts=\S+Z level=info logger=swap_state.test.logfmt ", line)


async def test_start_log_line_names_budget_socket_and_shm_dir(start, caplog, shm_dir):
    caplog.set_level(logging.INFO, logger="swap_state")
    server = await start()
    (record,) = [r for r in caplog.records if r.msg == "started"]
    fields = record.swap_state_fields
    assert fields["budget_bytes"] == 64 << 20 and fields["budget"] == "64.0MiB"
    assert fields["socket"] == server.socket_path and fields["shm_dir"] == shm_dir


async def test_heavy_allocation_does_not_starve_liveness(server, stub, connect, monkeypatch):
    original = server.arena.create_segment

    def slow_create(*args, **kwargs):
        time.sleep(1.0)  # stands in for faulting in tens of GiB
        return original(*args, **kwargs)

    monkeypatch.setattr(server.arena, "create_segment", slow_create)
    watcher = Trainer(connect(server), "watch")
    await watcher.attach()
    await watcher.keep_alive()
    worker = Trainer(stub, "work")
    await worker.attach()
    allocation = asyncio.create_task(worker.allocate([spec("m", (1024,))]))
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = 0
    while not allocation.done():
        await asyncio.wait_for(watcher.keepalive_call.read(), 1.0)  # interval is 0.2 s
        events += 1
        stats_started = loop.time()
        await stub.Stats(pb.StatsRequest(), timeout=1)
        assert loop.time() - stats_started < 0.5
    await allocation
    assert loop.time() - started >= 0.9 and events >= 3
    watcher.close()


def _openssl_cert(tmp_path) -> tuple[pathlib.Path, pathlib.Path] | None:
    if shutil.which("openssl") is None:
        return None
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


async def test_tcp_insecure_serves_and_a_taken_port_is_refused(start):
    server = await start(listen="tcp://127.0.0.1:0", insecure=True)
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and server.socket_path is None
    channel = grpc.aio.insecure_channel(server.address)
    try:
        reply = await pb_grpc.SwapStateStub(channel).Attach(pb.AttachRequest(job_id="t", rank=0, world_size=1))
        assert reply.generation == 1
    finally:
        await channel.close()
    with pytest.raises(StartupError):
        await start(listen=f"tcp://127.0.0.1:{port}", insecure=True)


async def test_tcp_with_tls(start, tmp_path):
    files = _openssl_cert(tmp_path)
    if files is None:
        pytest.skip("openssl is not installed")
    cert, key = files
    server = await start(listen="tcp://127.0.0.1:0", tls_cert=cert, tls_key=key)
    port = server.address.rsplit(":", 1)[1]
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    channel = grpc.aio.secure_channel(f"localhost:{port}", creds)
    try:
        reply = await pb_grpc.SwapStateStub(channel).Attach(pb.AttachRequest(job_id="t", rank=0, world_size=1))
        assert reply.generation == 1
    finally:
        await channel.close()
    plain = grpc.aio.insecure_channel(f"localhost:{port}")
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await pb_grpc.SwapStateStub(plain).Stats(pb.StatsRequest(), timeout=3)
    finally:
        await plain.close()

