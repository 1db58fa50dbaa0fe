"""``python -m bench.replica_ceiling``: how close memory-only replication (issue 50) can come to a raw TCP copy of the
same bytes on this machine, whatever the server's code around it: the sender's and the peer's work per byte alone, each
side a process pinned to a CPU of its own (as ``bench.replicas --isolate`` pins the two servers), no framing, checks or
control messages, the variants alternated in rounds, each beside the raw copy of its round.

Sender variants (512 MiB from a /dev/shm "segment"; pieces of 256 KiB, as ``writer.PIECE_BYTES``):

- ``raw``: ``sendall`` of the segment (the peer only receives, into a mapping kept between rounds);
- ``today``: a stager's copy into slots, then per piece ``pwrite`` into this host's tmpfs file, crc32, ``sendall``
  (the server's work per byte today);
- ``one-copy``: a stager's copy straight into this host's file, mapped and kept between rounds, then per piece crc32
  and ``sendall`` from the mapping (the design docs/benchmarks.md, "Three more tries", says a kept mapping needs).

Peer variants: ``buffered`` (the peer's work today: receive into a buffer, ``pwrite`` into the replica's file, crc32)
and ``in-place`` (receive straight into the replica's file, mapped and kept, then crc32 of the piece).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import socket
import statistics
import struct
import sys
import time

from swap_state.common.checksum import crc32

__all__ = ["main"]

PIECE = 256 << 10
FRAME = 8 << 20  # the most bytes one receive asks for (the wire's data frame)
SOCKET_BUFFER = 4 << 20  # as the replica wire's sockets
_HEAD = struct.Struct("<QQ")  # peer variant (0 receive only, 1 buffered, 2 in place), bytes
VARIANTS = {  # name: (sender, peer)
    "raw": ("raw", 0), "today": ("today", 1), "today, in place": ("today", 2), "one copy, in place": ("one-copy", 2)}


def _address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _mapped(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A /dev/shm file of ``size`` bytes, mapped and touched (a spare's pages exist: this measures no page's first
    allocation); unlinked at once, so nothing is left behind."""
    path = f"/dev/shm/swap-state-ceiling-{os.getpid()}-{name}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    mapping[:] = bytes(size)
    return fd, mapping


def _peer(sock: socket.socket, size: int) -> None:
    """Receive each round as its header says; answer one byte when all of it is in (and checksummed)."""
    fd, replica = _mapped("replica", size)
    buffer, view = bytearray(FRAME), memoryview(replica)
    while len(head := sock.recv(_HEAD.size, socket.MSG_WAITALL)) == _HEAD.size:
        variant, nbytes = _HEAD.unpack(head)
        position = value = 0
        while position < nbytes:
            if variant == 2:
                piece = view[position : position + min(PIECE, nbytes - position)]
                _receive(sock, piece)
                value = crc32(piece, value)
            else:
                piece = memoryview(buffer)[: min(FRAME, nbytes - position)]
                _receive(sock, piece)
                if variant == 1:
                    os.pwrite(fd, piece, position)
                    value = crc32(piece, value)
            position += piece.nbytes
        sock.sendall(b"k")


def _receive(sock: socket.socket, into: memoryview) -> None:
    got = 0
    while got < into.nbytes:
        n = sock.recv_into(into[got:], into.nbytes - got)
        if not n:
            raise ConnectionError("the sender closed the connection")
        got += n


def _send(sock: socket.socket, sender: str, peer: int, src: dict[str, tuple[int, mmap.mmap]], size: int) -> None:
    sock.sendall(_HEAD.pack(peer, size))
    segment = memoryview(src["segment"][1])
    if sender == "raw":
        for at in range(0, size, FRAME):
            sock.sendall(segment[at : at + FRAME])
        return
    staged_into = "slots" if sender == "today" else "file"
    staged = memoryview(src[staged_into][1])
    for at in range(0, size, 64 << 20):  # the stager, ahead of the writer
        ctypes.memmove(_address(src[staged_into][1]) + at, _address(src["segment"][1]) + at, min(64 << 20, size - at))
    value = 0
    for at in range(0, size, PIECE):
        piece = staged[at : at + PIECE]
        if sender == "today":
            os.pwrite(src["file"][0], piece, at)
        value = crc32(piece, value)
        sock.sendall(piece)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_ceiling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mib", type=int, default=512, help="bytes per copy, MiB")
    p.add_argument("--rounds", type=int, default=7, help="rounds, each variant once per round")
    args = p.parse_args(argv)
    size = args.mib << 20
    cpus = sorted(os.sched_getaffinity(0))
    listener = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:  # the peer
        os.sched_setaffinity(0, cpus[-1:])
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        try:
            _peer(conn, size)
        finally:
            os._exit(0)
    os.sched_setaffinity(0, cpus[:1])
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    src = {name: _mapped(name, size) for name in ("segment", "slots", "file")}
    src["segment"][1][:] = os.urandom(1 << 20) * (size >> 20)
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (sender, peer) in VARIANTS.items():
            began = time.monotonic()
            _send(sock, sender, peer, src, size)
            if sock.recv(1) != b"k":
                raise ConnectionError("the peer failed")
            rates[name].append(size / (time.monotonic() - began) / 1e9)
        for name in VARIANTS:
            ratios[name].append(rates[name][-1] / rates["raw"][-1])
    sock.close()
    os.waitpid(pid, 0)
    print(f"{args.mib} MiB, sender on CPU {cpus[0]}, peer on CPU {cpus[-1]}, {args.rounds} rounds "
          "(median / mean / worst)\n\n| variant | GB/s | ÷ raw TCP of its round |\n| --- | --- | --- |")
    for name in VARIANTS:
        cell = lambda v: f"{statistics.median(v):.2f} / {statistics.mean(v):.2f} / {min(v):.2f}"
        print(f"| {name} | {cell(rates[name])} | {cell(ratios[name])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
