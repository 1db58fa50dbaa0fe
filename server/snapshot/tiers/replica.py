"""The replica tier's writer: a step's files sent to a peer server's memory (``--replica-peers``)
through the write seam, each call of :class:`~.seam.TierWriter` one message
(:mod:`.replica_wire`); the peer (:mod:`.replica_receiver`) applies its directory's commit rule
once every file arrived as its index lists it. The first peer that takes a step gets all of it;
each writing thread has its own connection to it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from swap_state.common.addresses import ListenAddress
from swap_state.common.snapshot_errors import SnapshotError
from swap_state.common.snapshot_format import FileRecord, SnapshotIndex
from swap_state.server.snapshot.tiers.replica_wire import CONNECT_TIMEOUT_S, DATA_FRAME_BYTES, Connection, connect_to_peer
from swap_state.server.snapshot.tiers.seam import CommitResult, StepPlan, StepWrite, TierWriter
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter
from swap_state.server import _posix
from swap_state.server.snapshot.writing.sink import ChunkSink, copy_piece

__all__ = ["ReplicaTier", "SendingSink"]

SEND_BUFFERS = 3  # a data file's frame buffers: one fills while the others are sent
SEND_BUFFER_BYTES = 2 << 20  # a frame sent (at most DATA_FRAME_BYTES): 6 MiB of buffers per rank sending


@dataclasses.dataclass
class _Remote:
    """A step on its peer: the token its connections join it by, one connection per thread."""

    peer: ListenAddress
    token: str
    connections: dict[int, Connection]
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class ReplicaTier(TierWriter):
    """Steps written into a peer's memory (the seam's call order; thread-safe as it says)."""

    def __init__(self, peers: Sequence[ListenAddress], secret: bytes, limiter: BandwidthLimiter | None = None):
        self.peers, self._secret = tuple(peers), secret
        self.root = ",".join(peer.url for peer in self.peers)
        self._limiter = limiter or BandwidthLimiter(None)
        self._cancel = threading.Event()
        self._steps: dict[str, _Remote] = {}
        self._lock = threading.Lock()

    def prepare(self, plan: StepPlan) -> StepWrite:
        """The step on the first peer that takes it; SnapshotError naming each peer's refusal."""
        message = {"op": "prepare", "job_id": plan.job_id, "step": plan.step, "world_size": plan.world_size,
                   "tenant": plan.tenant, "keep": plan.keep, "replace": plan.replace, "bytes": plan.expected_bytes}
        why = []
        for peer in self.peers:
            try:
                conn = connect_to_peer(peer, self._secret, CONNECT_TIMEOUT_S)
            except SnapshotError as exc:
                why.append(str(exc))
                continue
            try:
                token = str(conn.request(message)["token"])
            except SnapshotError as exc:
                conn.close()
                why.append(str(exc))
                continue
            location = f"{peer.url}/{plan.job_id}/step-{plan.step}#{token[:8]}"
            with self._lock:
                self._steps[location] = _Remote(peer, token, {threading.get_ident(): conn})
            return StepWrite(plan, location, plan.ranks)
        raise SnapshotError(f"no replica peer took {plan.job_id}/step-{plan.step}: {'; '.join(why)}")

    def _connection(self, target: StepWrite) -> Connection:
        """This thread's connection to the step's peer (joining the step on a new one)."""
        with self._lock:
            remote = self._steps[str(target.location)]
        with remote.lock:
            conn = remote.connections.get(threading.get_ident())
        if conn is None:
            conn = connect_to_peer(remote.peer, self._secret)
            conn.request({"op": "join", "token": remote.token})
            with remote.lock:
                remote.connections[threading.get_ident()] = conn
        return conn

    def open_file(self, target: StepWrite, name: str) -> SendingSink:
        conn = self._connection(target)
        conn.send({"op": "open", "name": name})
        return SendingSink(conn, self._limiter, self._cancel)

    def write_file(self, target: StepWrite, name: str, data: bytes) -> None:
        self._connection(target).request({"op": "write", "name": name}, data)

    def finish_rank(self, target: StepWrite, rank: int, files: tuple[FileRecord, ...]) -> None:
        self._connection(target).request({"op": "finish_rank", "rank": rank, "files": [f.to_json() for f in files]})

    def finish(self, target: StepWrite, index: SnapshotIndex, layout: bytes | None) -> CommitResult:
        """The peer checks every file against ``index``, then commits (its directory's rule)."""
        try:
            conn = self._connection(target)
            conn.send({"op": "finish", "index": index.to_json(), "layout": layout is not None})
            if layout is not None:
                conn.send_data(layout)
            answer = conn.receive()
            if not answer.get("ok"):
                raise SnapshotError(f"replica peer {conn.peer} refused {index.snapshot_id}: {answer.get('error')}")
            return CommitResult(f"{conn.peer}:{answer.get('path')}", ())
        finally:
            self._close(target)

    def discard(self, target: StepWrite) -> bool:
        try:
            self._connection(target).request({"op": "discard"})
            return True
        except (SnapshotError, KeyError):
            return False
        finally:
            self._close(target)

    def close(self) -> None:
        """Abandon what is being sent (at shutdown)."""
        self._cancel.set()

    def _close(self, target: StepWrite) -> None:
        with self._lock:
            remote = self._steps.pop(str(target.location), None)
        if remote is not None:
            with remote.lock:
                for conn in remote.connections.values():
                    conn.close()


class SendingSink(ChunkSink):
    """A data file streamed to the peer: pieces fill a frame-sized buffer and a full one is sent
    by a thread of its own, so the writer waits on the network only while every buffer is in
    flight (a network slower than the disk); bytes another sink holds in memory
    (:meth:`put_held`) are sent from its file by reference instead. The peer checks the size at
    ``end`` and the crc32 against the rank's files (``finish_rank``)."""

    def __init__(self, conn: Connection, limiter: BandwidthLimiter, cancel: threading.Event):
        super().__init__()
        self._conn, self._limiter, self._cancel = conn, limiter, cancel
        self._free = collections.deque(bytearray(SEND_BUFFER_BYTES) for _ in range(SEND_BUFFERS))
        self._busy: collections.deque[tuple[bytearray | None, Future[None]]] = collections.deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-send")
        self._current = self._free.popleft()
        self._fill = 0
        self._held: tuple[int, int, int] | None = None  # (fd, offset, bytes) not sent yet

    def room(self) -> int:
        return SEND_BUFFER_BYTES - self._fill

    def put(self, data: memoryview) -> memoryview:
        if data.nbytes > self.room():
            raise ValueError(f"a piece of {data.nbytes} bytes does not fit the {self.room()} left")
        self._send_held()
        copy_piece(self._current, _posix.buffer_address(self._current), self._fill, data)
        self._pending = data.nbytes
        with memoryview(self._current) as whole:
            return whole[self._fill : self._fill + data.nbytes]

    def advance(self) -> None:
        self._fill += self._pending
        self.position += self._pending
        self._pending = 0
        if self._fill == SEND_BUFFER_BYTES:
            self._submit()

    def put_held(self, fd: int, offset: int, nbytes: int) -> None:
        """The final bytes ``[offset, offset + nbytes)`` of ``fd`` (a sink's :attr:`held_in`) next:
        sent from the file, frames of up to ``DATA_FRAME_BYTES``, no copy here."""
        if self._fill:
            self._submit()
        while nbytes:
            held = self._held
            if held is not None and (held[0] != fd or held[1] + held[2] != offset or held[2] == DATA_FRAME_BYTES):
                self._send_held()
                held = None
            start, size = (offset, 0) if held is None else held[1:]
            more = min(nbytes, DATA_FRAME_BYTES - size)
            self._held = (fd, start, size + more)
            offset, nbytes, self.position = offset + more, nbytes - more, self.position + more

    def _send_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._in_flight(None, self._pool.submit(self._send_file, *held))

    def _submit(self) -> None:
        self._in_flight(self._current, self._pool.submit(self._send_buffer, self._current, self._fill))
        self._current, self._fill = self._free.popleft(), 0

    def _in_flight(self, buffer: bytearray | None, future: Future[None]) -> None:
        """Track a send; wait for the oldest while no buffer is free or too many are in flight."""
        self._busy.append((buffer, future))
        while self._busy and (not self._free or len(self._busy) > SEND_BUFFERS):
            self._done(*self._busy.popleft())

    def _done(self, buffer: bytearray | None, future: Future[None]) -> None:
        future.result()
        if buffer is not None:
            self._free.append(buffer)

    def _send_buffer(self, buffer: bytearray, nbytes: int) -> None:
        self._pace(nbytes)
        with memoryview(buffer) as whole, whole[:nbytes] as data:
            self._conn.send_data(data)

    def _send_file(self, fd: int, offset: int, nbytes: int) -> None:
        self._pace(nbytes)
        self._conn.send_file(fd, offset, nbytes)

    def _pace(self, nbytes: int) -> None:
        if not self._limiter.acquire(nbytes, self._cancel):
            raise SnapshotError("the server is shutting down: the replica was abandoned")

    def finish(self) -> None:
        if self._fill:
            self._submit()
        self._send_held()
        while self._busy:
            self._done(*self._busy.popleft())
        self._conn.request({"op": "end", "bytes": self.position})

    def close(self) -> None:
        if any(not future.done() for _, future in self._busy):
            self._conn.abort()  # a failed file: a send stuck on the peer returns now
        self._pool.shutdown(wait=True)
        self._busy.clear()
        self._free.clear()  # the buffers go now, even while a traceback still holds the sink
        self._current = bytearray(0)
