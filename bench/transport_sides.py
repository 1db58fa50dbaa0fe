"""The sides of ``bench.transport``'s transfers, one per worker process: for each transport a
receiver and a sender (raw TCP, framed TCP, gRPC streaming, Mooncake TCP) and the one-process
ceilings, driven by JSON lines on stdin (``python -m bench.transport_sides SPEC``). Kept apart
from the benchmark that starts and times them: a Mooncake worker runs in another interpreter,
which imports only this module.
"""

from __future__ import annotations

import json
import mmap
import queue
import os
import socket
import struct
import sys
import time
import zlib
from typing import Any

__all__ = ["REPLY_TIMEOUT_S", "SIDES", "crc_impl", "worker"]

REPLY_TIMEOUT_S = 300.0  # the longest a side or the benchmark waits for the other

STREAM = struct.Struct("<4sQI")  # magic, total bytes, chunk bytes: the framed stream's header
CHUNK = struct.Struct("<QII")  # offset, length, crc32: each chunk's header (framed TCP and gRPC)
MAGIC = b"SSR1"
POISON = 0xA5
GRPC_METHOD = "/swapstate.bench.Replica/Push"


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def crc_impl():
    """(crc32, its name): the project's (ISA-L) where importable, else isal's, else zlib's."""
    try:
        from swap_state.common.checksum import IMPLEMENTATION, crc32

        return crc32, f"swap_state.common.checksum ({IMPLEMENTATION})"
    except ImportError:
        pass
    try:
        from isal.isal_zlib import crc32

        return crc32, "isal"
    except ImportError:
        return zlib.crc32, "zlib"


class _Mapping:
    """A /dev/shm file mapped shared (the source read-only unless ``write``)."""

    def __init__(self, path: str, size: int, write: bool):
        fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)
        self.size = size

    def address(self) -> int:
        import numpy as np

        return int(np.frombuffer(self.map, dtype=np.uint8).ctypes.data)

    def close(self) -> None:
        self.view.release()
        self.map.close()


class _Side:
    """One side of one transport in a worker process. The receiver's ``arm`` poisons its buffer,
    ``finish`` blocks until the bytes are in (and verified) and returns the timestamp and the
    untimed crc32 of the whole buffer; the sender's ``go`` sends and returns its timestamps."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.size = spec["size"]
        self.chunk = spec["chunk"]
        self.crc, self.crc_name = crc_impl()

    def info(self) -> dict[str, Any]:
        return {}

    def whole_crc(self, view: memoryview) -> int:
        value = 0
        for off in range(0, len(view), self.chunk):
            value = self.crc(view[off:off + self.chunk], value)
        return value & 0xFFFFFFFF

    def chunks(self):
        for off in range(0, self.size, self.chunk):
            yield off, min(self.chunk, self.size - off)

    def close(self) -> None:
        pass


class _Receiver(_Side):
    def __init__(self, spec):
        super().__init__(spec)
        self.dst = _Mapping(spec["dst"], self.size, write=True)

    def arm(self, cmd) -> dict[str, Any]:
        """A poison byte over the whole buffer (untimed), so that what was not sent shows."""
        block = bytes([POISON]) * self.chunk
        for off, length in self.chunks():
            self.dst.view[off:off + length] = block[:length]
        return {"armed": True}

    def result(self, t_end: float, error: str | None = None) -> dict[str, Any]:
        return {"t_end": t_end, "crc": self.whole_crc(self.dst.view), "error": error}

    def close(self) -> None:
        self.dst.close()


class _Sender(_Side):
    def __init__(self, spec, write: bool = False):
        super().__init__(spec)
        self.src = _Mapping(spec["src"], self.size, write=write)

    def info(self):
        return {"source_crc": self.whole_crc(self.src.view)}

    def close(self) -> None:
        self.src.close()


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:])
        if not got:
            raise ConnectionError(f"peer closed after {pos} of {n} bytes")
        pos += got


class _Local(_Receiver):
    """memcpy and crc32 rows: one process, the source and the shared destination mapped."""

    def __init__(self, spec):
        super().__init__(spec)
        self.src = _Mapping(spec["src"], self.size, write=False)

    def info(self):
        return {"source_crc": self.whole_crc(self.src.view)}

    def finish(self, cmd):
        if cmd["crc"]:  # the crc32 row: the whole source, chunk by chunk
            t0 = _now()
            value = 0
            for off, length in self.chunks():
                value = self.crc(self.src.view[off:off + length], value)
            t_end = _now()
            return {"t0": t0, "t_end": t_end, "crc": value & 0xFFFFFFFF, "error": None}
        t0 = _now()
        self.dst.view[:] = self.src.view
        t_end = _now()
        return {"t0": t0, **self.result(t_end)}

    def close(self):
        self.src.close()
        super().close()


class _RawReceiver(_Receiver):
    def __init__(self, spec):
        super().__init__(spec)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.sock = None

    def info(self):
        return {"port": self.listener.getsockname()[1]}

    def arm(self, cmd):
        if self.sock is None:
            self.sock, _ = self.listener.accept()
        return super().arm(cmd)

    def finish(self, cmd):
        view, pos = self.dst.view, 0
        while pos < self.size:
            got = self.sock.recv_into(view[pos:])
            if not got:
                raise ConnectionError(f"sender closed after {pos} bytes")
            pos += got
        return self.result(_now())

    def close(self):
        for s in (self.sock, self.listener):
            if s is not None:
                s.close()
        super().close()


class _RawSender(_Sender):
    def __init__(self, spec):
        super().__init__(spec)
        self.sock = socket.create_connection(("127.0.0.1", spec["port"]))

    def go(self, cmd):
        t0 = _now()
        self.sock.sendall(self.src.view)
        return {"t0": t0, "t1": _now()}

    def close(self):
        self.sock.close()
        super().close()


class _FramedReceiver(_RawReceiver):
    """Bounded: the stream header must announce at most this buffer and at most --chunk per
    chunk; every chunk header must come in order and inside the buffer."""

    def finish(self, cmd):
        small = bytearray(max(STREAM.size, CHUNK.size))
        head = memoryview(small)
        _recv_exact_into(self.sock, head[:STREAM.size])
        magic, total, chunk = STREAM.unpack_from(small)
        error = None
        if magic != MAGIC or total > self.size or not 0 < chunk <= self.chunk:
            error = f"refused stream header {magic!r} total={total} chunk={chunk}"
        expect = 0
        while error is None and expect < total:
            _recv_exact_into(self.sock, head[:CHUNK.size])
            off, length, crc = CHUNK.unpack_from(small)
            if off != expect or not 0 < length <= chunk or off + length > total:
                error = f"refused chunk header offset={off} length={length} (expected offset {expect})"
                break
            target = self.dst.view[off:off + length]
            _recv_exact_into(self.sock, target)
            if cmd["crc"] and (self.crc(target) & 0xFFFFFFFF) != crc:
                error = f"crc32 mismatch in the chunk at offset {off}"
            expect = off + length
        t_end = _now()
        self.sock.sendall(b"\x00" if error is None else b"\x01")
        return self.result(t_end, error)


class _FramedSender(_RawSender):
    def go(self, cmd):
        sock, view, crc = self.sock, self.src.view, self.crc
        t0 = _now()
        sock.sendall(STREAM.pack(MAGIC, self.size, self.chunk))
        for off, length in self.chunks():
            piece = view[off:off + length]
            sock.sendall(CHUNK.pack(off, length, (crc(piece) & 0xFFFFFFFF) if cmd["crc"] else 0))
            sock.sendall(piece)
        ack = sock.recv(1)
        t1 = _now()
        return {"t0": t0, "t1": t1, "ack": ack.hex()}


def _grpc_options(chunk: int) -> list[tuple[str, int]]:
    limit = chunk + CHUNK.size
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


class _GrpcReceiver(_Receiver):
    def __init__(self, spec):
        super().__init__(spec)
        import grpc
        from concurrent.futures import ThreadPoolExecutor

        self.done: queue.Queue = queue.Queue()
        self.verify = False
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2), options=_grpc_options(self.chunk))
        handler = grpc.stream_unary_rpc_method_handler(self._push)  # no (de)serializers: bytes
        service, method = GRPC_METHOD.strip("/").split("/")
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def info(self):
        return {"port": self.port}

    def _push(self, requests, context) -> bytes:
        error, expect = None, 0
        try:
            for message in requests:
                off, length, crc = CHUNK.unpack_from(message)
                if off != expect or length != len(message) - CHUNK.size or off + length > self.size:
                    error = f"refused message offset={off} length={length} (expected offset {expect})"
                    break
                target = self.dst.view[off:off + length]
                target[:] = memoryview(message)[CHUNK.size:]
                if self.verify and (self.crc(target) & 0xFFFFFFFF) != crc:
                    error = f"crc32 mismatch in the chunk at offset {off}"
                    break
                expect = off + length
            if error is None and expect != self.size:
                error = f"stream ended at {expect} of {self.size} bytes"
        except Exception as exc:  # noqa: BLE001 - reported, not swallowed
            error = f"{type(exc).__name__}: {exc}"
        self.done.put((_now(), error))
        return b"\x00" if error is None else b"\x01"

    def arm(self, cmd):
        self.verify = bool(cmd["crc"])
        return super().arm(cmd)

    def finish(self, cmd):
        t_end, error = self.done.get(timeout=REPLY_TIMEOUT_S)
        return self.result(t_end, error)

    def close(self):
        self.server.stop(grace=None)
        super().close()


class _GrpcSender(_Sender):
    def __init__(self, spec):
        super().__init__(spec)
        import grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{spec['port']}", options=_grpc_options(self.chunk))
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.push = self.channel.stream_unary(GRPC_METHOD)  # no serializers: bytes

    def go(self, cmd):
        view, crc, with_crc = self.src.view, self.crc, cmd["crc"]

        def messages():
            for off, length in self.chunks():
                piece = view[off:off + length]
                yield b"".join((CHUNK.pack(off, length, (crc(piece) & 0xFFFFFFFF) if with_crc else 0), piece))

        t0 = _now()
        reply = self.push(messages(), timeout=REPLY_TIMEOUT_S)
        return {"t0": t0, "t1": _now(), "ack": reply.hex()}

    def close(self):
        self.channel.close()
        super().close()


def _mooncake_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) returned {rc}")
    return engine


class _MooncakeReceiver(_Receiver):
    def __init__(self, spec):
        super().__init__(spec)
        self.engine = _mooncake_engine()
        self.addr = self.dst.address()
        rc = self.engine.register_memory(self.addr, self.size)
        if rc != 0:
            raise RuntimeError(f"register_memory of the receiver's buffer returned {rc}")

    def info(self):
        return {"session": f"127.0.0.1:{self.engine.get_rpc_port()}", "addr": self.addr}

    def finish(self, cmd):  # sent once the sender's transfer_sync_write returned
        error = None
        if cmd["crc"]:
            for (off, length), want in zip(self.chunks(), cmd["crcs"], strict=True):
                if (self.crc(self.dst.view[off:off + length]) & 0xFFFFFFFF) != want:
                    error = f"crc32 mismatch in the chunk at offset {off}"
                    break
        return self.result(_now(), error)

    def close(self):
        self.engine.unregister_memory(self.addr)
        super().close()


class _MooncakeSender(_Sender):
    def __init__(self, spec):
        super().__init__(spec, write=True)  # registered memory: mapped read-write
        self.engine = _mooncake_engine()
        self.addr = self.src.address()
        rc = self.engine.register_memory(self.addr, self.size)
        if rc != 0:
            raise RuntimeError(f"register_memory of the sender's source returned {rc}")

    def go(self, cmd):
        view, crc = self.src.view, self.crc
        t0 = _now()
        crcs = [crc(view[off:off + n]) & 0xFFFFFFFF for off, n in self.chunks()] if cmd["crc"] else []
        rc = self.engine.transfer_sync_write(self.spec["session"], self.addr, self.spec["addr"], self.size)
        t1 = _now()
        if rc != 0:
            raise RuntimeError(f"transfer_sync_write returned {rc}")
        return {"t0": t0, "t1": t1, "crcs": crcs}

    def close(self):
        self.engine.unregister_memory(self.addr)
        super().close()


SIDES = {
    ("local", "receiver"): _Local,
    ("raw", "receiver"): _RawReceiver, ("raw", "sender"): _RawSender,
    ("framed", "receiver"): _FramedReceiver, ("framed", "sender"): _FramedSender,
    ("grpc", "receiver"): _GrpcReceiver, ("grpc", "sender"): _GrpcSender,
    ("mooncake", "receiver"): _MooncakeReceiver, ("mooncake", "sender"): _MooncakeSender,
}


def worker(spec: dict[str, Any]) -> int:
    """One side, driven by JSON lines on stdin; one JSON line on stdout per reply. Anything else
    written to fd 1 (a library's prints) goes to stderr instead."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if spec.get("cpu") is not None:  # before any library starts its threads: they inherit it
        os.sched_setaffinity(0, {spec["cpu"]})

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        side = SIDES[(spec["transport"], spec["role"])](spec)
        reply({"ready": True, "pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)),
               "crc_impl": side.crc_name, **side.info()})
    except Exception as exc:  # noqa: BLE001 - the reason goes back to the benchmark
        reply({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            try:
                reply(getattr(side, cmd["op"])(cmd))
            except Exception as exc:  # noqa: BLE001
                reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker(json.loads(sys.argv[1])))
