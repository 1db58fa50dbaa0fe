"""The replica tier's writer: a step's files sent to a peer server's memory (``--replica-peers``) through the write
seam, each call of :class:`~.seam.TierWriter` one message (:mod:`.replica_wire`); the peer (:mod:`.replica_receiver`)
applies its directory's commit rule once every file arrived as its index lists it. The first peer that takes a step gets
all of it; each writing thread has its own connection to it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from swap_state.common.addresses import ListenAddress
from swap_state.common.snapshot_errors import SnapshotError
from swap_state.common.snapshot_format import FileRecord, SnapshotIndex
from swap_state.server.snapshot.tiers.replica_wire import (
    CONNECT_TIMEOUT_S, DATA_FRAME_BYTES, Connection, PeerCredentials, connect_to_peer)
from swap_state.server.snapshot.tiers.seam import CommitResult, StepPlan, StepWrite, TierWriter
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter
from swap_state.server import _posix
from swap_state.server.snapshot.writing.sink import ChunkSink, copy_piece

__all__ = ["ReplicaTier", "SendingSink"]


@dataclasses.dataclass
class _Remote:
    """A step on its peer: the token its connections join it by, one connection per thread."""

    peer: ListenAddress
    token: str
    connections: dict[int, Connection]
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class ReplicaTier(TierWriter):
    """Steps written into a peer's memory (the seam's call order; thread-safe as it says)."""

    def __init__(self, peers: Sequence[ListenAddress], credentials: PeerCredentials,
                 limiter: BandwidthLimiter | None = None):
        self.peers, self._credentials = tuple(peers), credentials
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
            conn = None
            try:
                conn = connect_to_peer(peer, self._credentials, CONNECT_TIMEOUT_S)
                token = str(conn.request(message)["token"])
            except SnapshotError as exc:
                if conn is not None:
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
            conn = connect_to_peer(remote.peer, self._credentials)
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
    """A data file streamed to the peer: each piece is sent once final (:meth:`advance`), in the writer's
    thread, from where it was put when that holds still (a slot, a bounce buffer), else from a copy made
    when put, before the writer checks what it read, so the check covers it (the trainer may write the
    segment right after the check). The piece was just placed, so the copy and the send read it from the
    CPU's cache (docs/benchmarks.md, "Pieces the cache holds"). A network slower than the disk paces the
    writer. The peer checks the size at ``end`` and the crc32 against the rank's files."""

    def __init__(self, conn: Connection, limiter: BandwidthLimiter, cancel: threading.Event):
        super().__init__()
        self._conn, self._limiter, self._cancel = conn, limiter, cancel
        self._piece = bytearray(0)  # grows to the largest piece (the writer's are 256 KiB)
        self._held: memoryview | None = None  # the piece to send: into ``_piece``, or a stable put's

    def room(self) -> int:
        return DATA_FRAME_BYTES

    def put(self, data: memoryview, stable: bool = False) -> memoryview:
        if data.nbytes > DATA_FRAME_BYTES:
            raise ValueError(f"a piece of {data.nbytes} bytes is over a data frame's {DATA_FRAME_BYTES}")
        self._release()
        if stable:
            self._held = data[:]
        else:
            if data.nbytes > len(self._piece):
                self._piece = bytearray(data.nbytes)
            copy_piece(self._piece, _posix.buffer_address(self._piece), 0, data)
            with memoryview(self._piece) as whole:
                self._held = whole[: data.nbytes]
        self._pending = data.nbytes
        return self._held[:]

    def advance(self) -> None:
        if not self._pending:
            return
        if not self._limiter.acquire(self._pending, self._cancel):
            raise SnapshotError("the server is shutting down: the replica was abandoned")
        self._conn.send_data(self._held)
        self._release()
        self.position += self._pending
        self._pending = 0

    def close(self) -> None:
        self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.release()

    def finish(self) -> None:
        self._conn.request({"op": "end", "bytes": self.position})
