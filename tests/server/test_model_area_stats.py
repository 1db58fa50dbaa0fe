"""The model area (``model.<fqn>`` tensors of whole-state snapshots) in Stats, /metrics,
``swap-state status`` and the over-budget message: operators see how much of a segment is
parameters, and a refused Allocate says so."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from swap_server_testkit import Trainer, spec

from swap_state.client import cli
from swap_state.proto import swap_state_pb2 as pb

MODEL_W = 3000  # float32: 12000 bytes of model tensor


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    body = data.decode().partition("\r\n\r\n")[2]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


async def _trainer(stub, job_id: str, tensors: list[pb.TensorSpec]) -> Trainer:
    trainer = Trainer(stub, job_id)
    await trainer.attach()
    await trainer.keep_alive()
    await trainer.allocate(tensors)
    return trainer


async def test_stats_and_metrics_show_the_model_area(start, connect):
    server = await start(metrics_port=_free_port(), metrics_host="127.0.0.1")
    stub = connect(server)
    whole = await _trainer(stub, "whole", [spec("m.exp_avg", (1000,)), spec("model.w", (MODEL_W,))])
    plain = await _trainer(stub, "plain", [spec("m.exp_avg", (1000,))])

    reply = await stub.Stats(pb.StatsRequest(), timeout=5)
    by_job = {s.job_id: s for s in reply.sessions}
    assert by_job["whole"].model_bytes == 4 * MODEL_W
    assert by_job["plain"].model_bytes == 0

    samples = await _scrape(server.metrics_address[1])
    family = "swap_state_session_model_area_bytes"
    assert samples[(family, (("job_id", "whole"), ("rank", "0")))] == 4 * MODEL_W
    assert samples[(family, (("job_id", "plain"), ("rank", "0")))] == 0
    whole.close()
    plain.close()


async def test_over_budget_says_how_much_is_the_model(start, connect):
    server = await start(shm_size=8 << 20, cow_budget=256 << 10)
    trainer = Trainer(connect(server))
    await trainer.attach()
    model = 2 << 20  # float32: 8 MiB of the request is the model
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.allocate([spec("m.exp_avg", (1 << 20,)), spec("model.w", (model,))])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = err.value.details()
    assert f"of which {4 * model} bytes (8.0MiB) are the model's parameters and buffers" in details
    assert "RemoteConfig.snapshot_model=False" in details
    assert f"total {8 << 20}" in details  # the numbers stay

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.allocate([spec("big", (3 << 20,))])
    assert "model" not in err.value.details()  # no model tensors, no clause


async def test_cli_status_shows_the_model_area(start, connect, capsys):
    server = await start()
    stub = connect(server)
    whole = await _trainer(stub, "whole", [spec("m.exp_avg", (1000,)), spec("model.w", (1 << 20,))])
    plain = await _trainer(stub, "plain", [spec("m.exp_avg", (1000,))])

    # The CLI's client is synchronous: off the loop, which serves it.
    assert await asyncio.to_thread(cli.main, ["status", "--server", server.address]) == 0
    lines = capsys.readouterr().out.splitlines()
    whole_line = next(line for line in lines if "whole/rank 0/1 " in line)
    plain_line = next(line for line in lines if "plain/rank 0/1 " in line)
    assert "(model 0.004 GiB) last step -" in whole_line  # 4 MiB
    assert "model" not in plain_line
    whole.close()
    plain.close()
