"""Malformed and oversize requests: the right status code each, and the server keeps serving."""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest
from swap_server_testkit import Trainer, spec

from swap_state.proto import swap_state_pb2 as pb
from swap_state.common.segment import tensor_nbytes
from swap_state.common.snapshot_format import DATA_ALIGN, safetensors_header
from swap_state.server.rpc import validation as vd
from swap_state.server.rpc.validation import validate_job_id, validate_tensor_specs
from swap_state.common.errors import InvalidRequestError

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "job_id",
    ["", "../x", "..", ".", ".hidden", "a/b", "a b", "x" * 129, "job\x00", "jöb", "\\..\\x"],
)
def test_bad_job_ids_are_rejected(job_id):
    with pytest.raises(InvalidRequestError):
        validate_job_id(job_id)


def test_good_ids_and_specs_pass():
    assert validate_job_id("llama-3.1_8b") == "llama-3.1_8b"
    checked = validate_tensor_specs(
        [("state.layers.0:exp_avg/x-1", "bfloat16", [0, 4]), ("s", "int64", []), ("model.w", "float32", [2])],
        max_tensors=3,
    )
    assert checked == [
        ("state.layers.0:exp_avg/x-1", "bfloat16", (0, 4)), ("s", "int64", ()), ("model.w", "float32", (2,))
    ]


def test_model_tensors_before_other_tensors_are_refused():
    with pytest.raises(InvalidRequestError, match=r"model tensors \(model\.\*\) must come after every other"):
        validate_tensor_specs([("model.w", "float32", [2]), ("s", "int64", [])], max_tensors=2)


def test_the_header_bound_holds_and_refuses_a_header_safetensors_would_not_read():
    specs = [
        ("state." + "w" * 200 + ".exp_avg", "bfloat16", [2**40, 3]),
        ("s", "int64", []),
        ("model." + "x" * 400, "float32", [7, 2**20, 1, 5]),
    ]
    names = [(name, dtype, shape, tensor_nbytes(dtype, shape)) for name, dtype, shape in specs]
    header, _ = safetensors_header(names, {})
    bound = DATA_ALIGN + sum(len(n) + vd._HEADER_BYTES_PER_TENSOR + vd._HEADER_BYTES_PER_DIM * len(d)
                             for n, _, d in specs)  # the padding that block-aligns the data first
    assert len(header) - len('{"__metadata__":{}}') - 8 <= bound
    many = [(f"state.{i:0490d}.exp_avg", "float32", [1]) for i in range(200_000)]
    with pytest.raises(InvalidRequestError, match=r"safetensors header of up to .* \(shard the model over more ranks\)"):
        validate_tensor_specs(many, max_tensors=1 << 20)


async def test_burst_of_malformed_requests_leaves_the_server_serving(start, connect, shm_dir):
    server = await start(max_message_bytes=1 << 20, max_tensors=1000)
    stub = connect(server)
    owner = Trainer(stub, "owner")
    await owner.attach()
    # Live for the whole burst: without its stream the session is freed after stream_wait +
    # grace (1 s here), which the burst took once on a loaded CI machine.
    await owner.keep_alive()
    sid, gen = owner.session_id, owner.generation

    def alloc(tensors, session_id=sid, generation=gen):
        return stub.Allocate(pb.AllocateRequest(session_id=session_id, generation=generation,
                                                tensors=tensors), timeout=10)

    def attach(job_id="j", rank=0, world_size=1, host="h"):
        return stub.Attach(pb.AttachRequest(job_id=job_id, rank=rank, world_size=world_size,
                                            client_host=host), timeout=10)

    cases = [
        (attach(job_id="../x"), INVALID),
        (attach(job_id="../../etc/passwd"), INVALID),
        (attach(job_id=".."), INVALID),
        (attach(job_id=""), INVALID),
        (attach(job_id="x" * 129), INVALID),
        (attach(job_id="a\nb"), INVALID),
        (attach(rank=4, world_size=4), INVALID),
        (attach(world_size=0), INVALID),
        (attach(host="\x00" * 10), INVALID),
        (attach(host="h" * 300), INVALID),
        (alloc([spec("huge", (1 << 62, 1 << 62))]), INVALID),
        (alloc([spec("huge", (1 << 40,) * 8)]), INVALID),
        (alloc([spec("neg", (4, -1))]), INVALID),
        (alloc([spec("dtype", (4,), "complex128")]), INVALID),
        (alloc([spec("dtype", (4,), "")]), INVALID),
        (alloc([spec("..\\\\etc shadow", (4,))]), INVALID),  # "/" and ".." are legal in names
        (alloc([spec("", (4,))]), INVALID),
        (alloc([spec("a" * 513, (4,))]), INVALID),
        (alloc([spec("dup", (4,)), spec("dup", (4,))]), INVALID),
        (alloc([spec("ndim", (1,) * 33)]), INVALID),
        (alloc([spec(f"t{i}", (1,)) for i in range(1001)]), INVALID),  # > max_tensors
        (alloc([spec("big", (1 << 40,))]), grpc.StatusCode.RESOURCE_EXHAUSTED),  # 4 TiB > budget
        (alloc([spec(f"n{i}-" + "x" * 500, (1,)) for i in range(2500)]),
         grpc.StatusCode.RESOURCE_EXHAUSTED),  # > 1 MiB message
        (alloc([spec("x", (1,))], session_id="f" * 32), grpc.StatusCode.NOT_FOUND),
        (alloc([spec("x", (1,))], session_id="../" * 10), INVALID),
        (alloc([spec("x", (1,))], session_id=""), INVALID),
        (alloc([spec("x", (1,))], generation=0), INVALID),
        (alloc([spec("x", (1,))], generation=gen + 7), grpc.StatusCode.FAILED_PRECONDITION),
        (stub.CommitStep(pb.CommitStepRequest(session_id=sid, generation=gen, step=1 << 63)), INVALID),
        (stub.CommitStep(pb.CommitStepRequest(session_id="0" * 32, generation=1, step=1)),
         grpc.StatusCode.NOT_FOUND),
        (stub.Detach(pb.DetachRequest(session_id="nope", generation=1)), INVALID),
        (stub.KeepAlive(pb.KeepAliveRequest(session_id="0" * 32, generation=1)).read(),
         grpc.StatusCode.NOT_FOUND),
        (stub.KeepAlive(pb.KeepAliveRequest(session_id=sid, generation=0)).read(), INVALID),
    ]
    results = await asyncio.gather(*(call for call, _ in cases), return_exceptions=True)
    for index, ((_, expected), result) in enumerate(zip(cases, results)):
        assert isinstance(result, grpc.aio.AioRpcError), (index, result)
        assert result.code() == expected, (index, result.code(), result.details())

    # Bytes that are not a protobuf message at all, and a method that does not exist.
    raw = stub.channel.unary_unary("/swap_state.v1.SwapState/Allocate")
    with pytest.raises(grpc.aio.AioRpcError):
        await raw(b"\xff\xff\xff\xff garbage", timeout=5)
    unknown = stub.channel.unary_unary("/swap_state.v1.SwapState/Explode")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unknown(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # Not even HTTP/2 on the socket.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(server.socket_path))
    sock.sendall(os.urandom(4096))
    sock.close()

    # Nothing was allocated, no file appeared, and a well-formed trainer works.
    assert server.arena.used_bytes == 0 and os.listdir(shm_dir) == []
    trainer = Trainer(connect(server), "good", rank=0, world_size=1)
    await trainer.attach()
    await trainer.keep_alive()
    await trainer.allocate([spec("m", (1024,))])
    assert (await trainer.commit(0)).committed_step == 0
    assert (await owner.allocate([spec("m", (8,))])).segment.size > 0
    trainer.close()


LONG = "x" * 20_000


async def test_a_huge_id_is_invalid_argument_with_a_short_message_in_every_rpc(
    start, connect, tmp_path
):
    """Every id field of every RPC (not only Attach): a 20,000-character value is refused as
    INVALID_ARGUMENT quoting it shortened, never RESOURCE_EXHAUSTED (an error message that
    repeats the id overflows the gRPC metadata limit)."""
    server = await start(snapshot_dir=tmp_path / "snapshots")
    stub = connect(server)
    trainer = Trainer(stub, "huge-ids")
    await trainer.attach()
    await trainer.keep_alive()
    await trainer.allocate([spec("m", (16,))])
    await trainer.commit(0)
    sid, gen = trainer.session_id, trainer.generation
    long_digits = "1" * 20_000
    cases = {
        ("Attach", "job_id"): stub.Attach(pb.AttachRequest(job_id=LONG, rank=0, world_size=1)),
        ("Attach", "client_host"): stub.Attach(
            pb.AttachRequest(job_id="j", rank=0, world_size=1, client_host=LONG)),
        ("KeepAlive", "session_id"): stub.KeepAlive(
            pb.KeepAliveRequest(session_id=LONG, generation=gen)).read(),
        ("Allocate", "session_id"): stub.Allocate(
            pb.AllocateRequest(session_id=LONG, generation=gen, tensors=[spec("m", (16,))])),
        ("Allocate", "tensors.name"): stub.Allocate(
            pb.AllocateRequest(session_id=sid, generation=gen, tensors=[spec(LONG, (16,))])),
        ("Allocate", "tensors.dtype"): stub.Allocate(
            pb.AllocateRequest(session_id=sid, generation=gen, tensors=[spec("m", (16,), LONG)])),
        ("CommitStep", "session_id"): stub.CommitStep(
            pb.CommitStepRequest(session_id=LONG, generation=gen, step=1)),
        ("Detach", "session_id"): stub.Detach(pb.DetachRequest(session_id=LONG, generation=gen)),
        ("Snapshot", "session_id"): stub.Snapshot(
            pb.SnapshotRequest(session_id=LONG, generation=gen, step=0)),
        ("SnapshotStatus", "snapshot_id"): stub.SnapshotStatus(
            pb.SnapshotStatusRequest(snapshot_id=LONG)),
        ("SnapshotStatus", "snapshot_id job"): stub.SnapshotStatus(
            pb.SnapshotStatusRequest(snapshot_id=f"{LONG}/step-0")),
        ("SnapshotStatus", "snapshot_id step"): stub.SnapshotStatus(
            pb.SnapshotStatusRequest(snapshot_id=f"huge-ids/step-{long_digits}")),
        ("ListSnapshots", "job_id"): stub.ListSnapshots(pb.ListSnapshotsRequest(job_id=LONG)),
        ("Restore", "session_id"): stub.Restore(
            pb.RestoreRequest(session_id=LONG, generation=gen, snapshot_id="latest")),
        ("Restore", "snapshot_id"): stub.Restore(
            pb.RestoreRequest(session_id=sid, generation=gen, snapshot_id=LONG)),
        ("Restore", "snapshot_id job"): stub.Restore(
            pb.RestoreRequest(session_id=sid, generation=gen, snapshot_id=f"{LONG}/latest")),
        # The numbers among the ids: out of range, refused at the same place.
        ("Attach", "rank"): stub.Attach(pb.AttachRequest(job_id="j", rank=(1 << 32) - 1, world_size=1)),
        ("KeepAlive", "generation"): stub.KeepAlive(
            pb.KeepAliveRequest(session_id=sid, generation=0)).read(),
        ("Snapshot", "generation"): stub.Snapshot(
            pb.SnapshotRequest(session_id=sid, generation=0, step=0)),
        ("Snapshot", "step"): stub.Snapshot(
            pb.SnapshotRequest(session_id=sid, generation=gen, step=(1 << 64) - 1)),
        ("SnapshotStatus", "rank"): stub.SnapshotStatus(
            pb.SnapshotStatusRequest(snapshot_id="huge-ids/step-0", rank=(1 << 32) - 1)),
        ("Restore", "generation"): stub.Restore(
            pb.RestoreRequest(session_id=sid, generation=0, snapshot_id="latest")),
    }
    # Every RPC that carries an id is covered (Stats carries none).
    methods = set(pb.DESCRIPTOR.services_by_name["SwapState"].methods_by_name) - {"Stats"}
    assert {method for method, _ in cases} == methods

    results = await asyncio.gather(*cases.values(), return_exceptions=True)
    for case, result in zip(cases, results):
        assert isinstance(result, grpc.aio.AioRpcError), (case, result)
        details = result.details() or ""
        assert result.code() == INVALID, (case, result.code(), details[:200])
        assert len(details) < 400 and LONG not in details and long_digits not in details, (case, details)
        if case[1] not in ("client_host", "rank", "generation", "step"):
            assert "...'" in details, (case, details)  # the id is quoted, cut by shorten()
        reasons = dict(result.trailing_metadata() or ())
        assert reasons.get("swap-state-reason") == "INVALID_ARGUMENT", (case, reasons)

    # Nothing changed for the well-formed session.
    assert (await trainer.commit(1)).committed_step == 1
    trainer.close()
