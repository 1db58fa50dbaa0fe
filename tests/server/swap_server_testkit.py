"""Helpers for the server tests: a minimal trainer-side client and a server process wrapper.

(Not a conftest: plain functions and classes, imported as ``swap_server_testkit``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swap_state.common import trainer_presence
from swap_state.common.segment import layout_hash
from swap_state.common.segment_descriptor import SegmentDescriptor
from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc

__all__ = [
    "Trainer",
    "ServerProcess",
    "descriptor",
    "spec",
    "wait_until",
]


def spec(name: str, shape: tuple[int, ...], dtype: str = "float32") -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=dtype, shape=list(shape))


def descriptor(specs, world_size: int = 1, job_id: str = "job", rank: int = 0) -> SegmentDescriptor:
    """What ``Arena.create_segment`` takes: the segment of ``specs`` of a job whose ranks are all here."""
    specs = tuple((name, dtype, tuple(shape)) for name, dtype, shape in specs)
    return SegmentDescriptor(job_id, rank, world_size, world_size, specs, layout_hash(specs))


async def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)


class Trainer:
    """What a trainer rank does against the server, minus the device: attach, keep alive,
    allocate, map the segment, commit."""

    def __init__(self, stub: pb_grpc.SwapStateStub, job_id: str = "job", rank: int = 0,
                 world_size: int = 1) -> None:
        self.stub = stub
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.attach_reply: pb.AttachReply | None = None
        self.segment: pb.SegmentInfo | None = None
        self.keepalive_call = None
        self.mapping: mmap.mmap | None = None

    @property
    def session_id(self) -> str:
        assert self.attach_reply is not None
        return self.attach_reply.session_id

    @property
    def generation(self) -> int:
        assert self.attach_reply is not None
        return self.attach_reply.generation

    async def attach(self) -> pb.AttachReply:
        self.attach_reply = await self.stub.Attach(
            pb.AttachRequest(job_id=self.job_id, rank=self.rank, world_size=self.world_size,
                             client_pid=os.getpid(), client_host="test"),
            timeout=10,
        )
        if self.attach_reply.has_segment:
            self.segment = self.attach_reply.segment
        return self.attach_reply

    async def keep_alive(self) -> pb.KeepAliveEvent:
        """Open the liveness stream; returns once the server sent its first event (so the
        session is live by then)."""
        self.keepalive_call = self.stub.KeepAlive(
            pb.KeepAliveRequest(session_id=self.session_id, generation=self.generation)
        )
        return await asyncio.wait_for(self.keepalive_call.read(), 10)

    def drop_keep_alive(self) -> None:
        if self.keepalive_call is not None:
            self.keepalive_call.cancel()
            self.keepalive_call = None

    async def allocate(self, tensors: list[pb.TensorSpec]) -> pb.AllocateReply:
        reply = await self.stub.Allocate(
            pb.AllocateRequest(session_id=self.session_id, generation=self.generation,
                               tensors=tensors),
            timeout=30,
        )
        self.segment = reply.segment
        return reply

    async def commit(self, step: int, generation: int | None = None) -> pb.CommitStepReply:
        return await self.stub.CommitStep(
            pb.CommitStepRequest(session_id=self.session_id,
                                 generation=self.generation if generation is None else generation,
                                 step=step),
            timeout=10,
        )

    async def detach(self, keep: bool = False) -> None:
        await self.stub.Detach(
            pb.DetachRequest(session_id=self.session_id, generation=self.generation, keep=keep),
            timeout=10,
        )

    def map(self) -> mmap.mmap:
        """Map the segment as the trainer does: the file kept open and its presence lock held
        (:mod:`swap_state.common.trainer_presence`) until :meth:`close`."""
        assert self.segment is not None
        self.segment_fd = os.open(self.segment.path, os.O_RDWR)
        self.mapping = mmap.mmap(self.segment_fd, self.segment.size)
        trainer_presence.hold(self.segment_fd)
        return self.mapping

    def close(self) -> None:
        self.drop_keep_alive()
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
            os.close(self.segment_fd)


class ServerProcess:
    """``python -m swap_state.server`` in a subprocess; stderr goes to a file (never a pipe
    that could fill up). Always reaped: :meth:`kill` on teardown."""

    def __init__(self, args: list[str], log_path: pathlib.Path, env: dict[str, str] | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swap_state.server", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit within {timeout}s; output:\n{self.output}")

    def wait_ready(self, socket_path: pathlib.Path, timeout: float = 20.0,
                   metadata: tuple = ()) -> None:
        """Until the health service says SERVING (or the process died)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output}")
            if socket_path.exists():
                with grpc.insecure_channel(f"unix://{socket_path}") as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    with contextlib.suppress(grpc.RpcError):
                        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1,
                                           metadata=metadata)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"server not ready within {timeout}s:\n{self.output}")

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
