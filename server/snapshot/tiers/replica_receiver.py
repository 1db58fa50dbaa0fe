"""The peer's side of the replica tier: ``--replica-listen`` accepts the servers that hold the secret and writes each
step they send through a :class:`~.directory.SnapshotDirectory` kept in memory (under ``--shm-dir``, so a restarted
server finds its replicas), with its commit rule. Each file's size and crc32 are checked as it arrives and against the
step's index before the step is complete; at most ``--replica-size`` bytes are held (oldest replicas evicted first,
never a job's newest). One thread per connection; the sender's call order is the seam's (:class:`~.seam.TierWriter`),
each call one message (:mod:`.replica`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from swap_state.common.addresses import ListenAddress
from swap_state.common.checksum import crc32
from swap_state.common.names import validate_job_id
from swap_state.common.snapshot_errors import SnapshotError, SnapshotInvalid
from swap_state.common.snapshot_format import (
    LAYOUT_NAME, MAX_LAYOUT_BYTES, FileRecord, SnapshotIndex, rank_data_name, rank_manifest_name)
from swap_state.common.snapshot_tier import SnapshotTier
from swap_state.common.sizes import format_size
from swap_state.server.logs import log_event
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.replica_wire import (
    DATA_FRAME_BYTES, IO_TIMEOUT_S, Connection, PeerCredentials, WireError, accept_sender)
from swap_state.server.snapshot.tiers.seam import StepPlan, StepWrite

__all__ = ["ReplicaReceiver"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # senders served at once (a host's ranks each write on their own connection)
MAX_READ_BYTES = 256 << 20  # the most one read returns (a tensor of a restore; it asks again for more)


class _Refusal(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class _Step:
    """A step being received: the senders' connections join it by its token."""

    target: StepWrite
    nbytes: int  # declared at prepare, or what arrived when more: held against --replica-size until finished
    arrived: int = 0  # bytes received so far
    received: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # name -> (bytes, crc32)
    failed: str = ""
    touched: float = dataclasses.field(default_factory=time.monotonic)


class ReplicaReceiver:
    """Accepts replicas from peers into ``directory`` (in memory), at most ``size`` bytes."""

    def __init__(self, listen: ListenAddress, credentials: PeerCredentials, directory: SnapshotDirectory, size: int,
                 job_owner: Callable[[str], str | None] = lambda job_id: None, host: SnapshotTier | None = None):
        """``job_owner(job)``: the tenant this server knows as the job's (its own snapshots), or
        None; ``host``: what peers may read (this host's snapshots and replicas; default: the replicas)."""
        self.listen, self.directory, self.size = listen, directory, size
        self.host = host or directory.reader
        self._credentials, self._job_owner = credentials, job_owner
        self._steps: dict[str, _Step] = {}
        self.counters: collections.Counter[str] = collections.Counter()  # "complete", "bytes", "refused" (metrics)
        self._lock = threading.Lock()
        self._room = threading.Lock()  # held while room is made and reserved: two steps never take the same
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self.port = 0

    def start(self) -> int:
        """Listen (``--replica-listen``) and serve in a thread; the bound port."""
        family = socket.AF_INET6 if ":" in self.listen.host else socket.AF_INET
        self._sock = socket.create_server((self.listen.host, self.listen.port), family=family, backlog=MAX_CONNECTIONS)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="replica-listen", daemon=True).start()
        return self.port

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def held_bytes(self) -> int:
        """Bytes of complete replicas, of steps being received (declared) and of spare files."""
        with self._lock:
            receiving = sum(step.nbytes for step in self._steps.values())
        spares = self.directory.spares.bytes if self.directory.spares is not None else 0
        return receiving + spares + sum(info.bytes for info in self.directory.reader.list())

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                sock, address = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                sock.close()  # the sender retries or fails the replica; the snapshot stays durable
                log_event(log, "replica_connection_refused", logging.WARNING, peer=str(address[0]),
                          detail=f"more than {MAX_CONNECTIONS} connections")
                continue
            threading.Thread(target=self._serve, args=(sock, f"{address[0]}:{address[1]}"), daemon=True,
                             name="replica-receive").start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn, step = None, None
        try:
            conn = accept_sender(sock, peer, self._credentials)
            while not self._closed.is_set():
                message = conn.receive()
                try:
                    step = self._handle(conn, message, step)
                except _Refusal as refusal:
                    conn.send({"ok": False, "reason": refusal.reason, "error": str(refusal)})
                except (ValueError, TypeError, KeyError) as exc:  # a malformed message of a peer
                    conn.send({"ok": False, "reason": "invalid", "error": f"a malformed {message.get('op')!r}: {exc}"})
                except (SnapshotError, OSError) as exc:
                    conn.send({"ok": False, "reason": "failed", "error": str(exc)})
        except WireError as exc:
            if step is not None and "closed the connection" not in str(exc):
                step.failed = step.failed or str(exc)
            if conn is None:  # not authenticated: worth an operator's look
                with self._lock:
                    self.counters["refused"] += 1
                log_event(log, "replica_connection_refused", logging.WARNING, peer=peer, detail=str(exc))
            else:
                log_event(log, "replica_connection_ended", logging.DEBUG, peer=peer, why=str(exc))
        finally:
            (sock if conn is None else conn).close()
            self._slots.release()

    def _handle(self, conn: Connection, message: dict[str, Any], step: _Step | None) -> _Step | None:
        """One message of a sender (the seam's calls, in its order); the step it works on after."""
        op = message.get("op")
        small = bytes(conn.receive_data()) if op == "write" else b""  # read before any refusal: in step
        if op in ("list", "read"):
            self._serve_read(conn, op, message)
            return step
        if op == "prepare":
            token, step = self._prepare(message)
            conn.send({"ok": True, "token": token})
            return step
        if op == "join":
            with self._lock:
                step = self._steps.get(str(message.get("token")))
            if step is None:
                raise _Refusal("unknown_step", "no step with that token is being received (it failed or finished)")
            conn.send({"ok": True})
            return step
        if step is None:
            raise _Refusal("no_step", f"{op!r} before prepare or join")
        if step.failed:
            raise _Refusal("failed", f"the step failed: {step.failed}")
        step.touched = time.monotonic()
        if op == "open":
            self._receive_file(conn, step, self._file_name(step, message.get("name")))
        elif op == "write":
            name = self._file_name(step, message.get("name"))
            self._reserve(step, len(small))
            self.directory.write_file(step.target, name, small)
            step.received[name] = (len(small), crc32(small))
        elif op == "finish_rank":
            files = tuple(FileRecord.from_json(raw) for raw in message.get("files", ()))
            self._check_received(step, files)
            self.directory.finish_rank(step.target, int(message.get("rank", -1)), files)
        elif op == "finish":
            return self._finish(conn, step, message)
        elif op == "discard":
            self._forget(step)
            self.directory.discard(step.target)
        else:
            raise _Refusal("unknown_op", f"unknown operation {str(op)[:40]!r}")
        conn.send({"ok": True})
        return step

    def _serve_read(self, conn: Connection, op: str, message: dict[str, Any]) -> None:
        """A peer restoring a lost host's ranks: the complete steps of a job here, or a file's bytes
        (the reader checks them against the index it listed)."""
        try:
            job_id = validate_job_id(str(message.get("job_id", "")), SnapshotInvalid)
            if op == "list":
                conn.send({"ok": True, "snapshots": [info.index.to_json() for info in self.host.list(job_id)]})
                return
            info = self.host.resolve(f"{job_id}/step-{int(message['step'])}")
            name, offset, nbytes = str(message["name"]), int(message["offset"]), int(message["nbytes"])
            if name not in {record.name for record in info.index.files} | {LAYOUT_NAME} or offset < 0 or nbytes < 0:
                raise _Refusal("invalid", f"{name[:60]!r} at {offset}+{nbytes} is not a file range of {info.snapshot_id}")
            data = self.host.read_range(info, name, offset, min(nbytes, MAX_READ_BYTES))
        except (KeyError, TypeError, ValueError) as exc:
            raise _Refusal("invalid", f"a malformed {op}: {exc}") from None
        conn.send({"ok": True, "bytes": len(data)})
        with memoryview(data) as view:
            for start in range(0, len(data), DATA_FRAME_BYTES):
                conn.send_data(view[start : start + DATA_FRAME_BYTES])

    def _prepare(self, message: dict[str, Any]) -> tuple[str, _Step]:
        try:
            job_id = validate_job_id(str(message.get("job_id", "")), SnapshotInvalid)
            step, world_size, nbytes = (int(message[key]) for key in ("step", "world_size", "bytes"))
            tenant, keep = str(message.get("tenant", "")), message.get("keep")
            keep = None if keep is None else int(keep)
        except (KeyError, TypeError, ValueError) as exc:
            raise _Refusal("invalid", f"a malformed prepare: {exc}") from None
        if step < 0 or world_size < 1 or nbytes < 0:
            raise _Refusal("invalid", "step, world_size and bytes must be >= 0, >= 1, >= 0")
        replicas = self.directory.reader.list(job_id)
        owner = replicas[-1].index.tenant if replicas else self._job_owner(job_id)
        if owner is not None and owner != tenant:
            raise _Refusal("permission_denied", f"job {job_id} belongs to another tenant on this peer")
        plan = StepPlan(job_id, step, world_size, (), tenant, keep, replace=bool(message.get("replace")))
        with self._room:
            self._make_room(job_id, step, nbytes)
            token, state = secrets.token_hex(16), _Step(self.directory.prepare(plan), nbytes)
            with self._lock:
                self._steps[token] = state
        log_event(log, "replica_receiving", job_id=job_id, step=step, bytes=nbytes)
        return token, state

    def _reserve(self, step: _Step, nbytes: int) -> None:
        """``nbytes`` more arrived for ``step``: past what its prepare declared (an estimate),
        room is made for them; _Refusal when there is none."""
        with self._room:
            step.arrived += nbytes
            if step.arrived > step.nbytes:
                plan = step.target.plan
                self._make_room(plan.job_id, plan.step, step.arrived - step.nbytes)
                step.nbytes = step.arrived

    def _make_room(self, job_id: str, step: int, nbytes: int) -> None:
        """Room for ``nbytes`` more; a step arriving alone counts the largest spare file as its own (its first data
        file is written over it: fresh memory costs a page's zeroing). The other spares are dropped first, then that
        one, then the oldest replicas evicted (never a job's newest; their files become spares); _Refusal else."""
        self._drop_abandoned()
        spares = self.directory.spares
        while True:
            with self._lock:
                alone = not self._steps
            reused = min(spares.largest(), nbytes) if spares is not None and alone else 0
            if self.held_bytes() - reused + nbytes <= self.size:
                return
            if spares is not None and spares.bytes:  # every other spare first, then the one written over
                spares.drop(keep_largest=alone and spares.bytes > spares.largest())
                continue
            complete = self.directory.reader.list()
            newest = {info.job_id: info.step for info in complete}
            evictable = sorted((info for info in complete if info.step != newest[info.job_id]),
                               key=lambda info: info.index.created_unix)
            if not evictable:
                raise _Refusal("replica_full", f"{job_id}/step-{step} needs {format_size(nbytes)}; this peer's "
                               f"--replica-size {format_size(self.size)} holds {format_size(self.held_bytes())} "
                               "of replicas it may not evict (each job's newest): raise --replica-size")
            self.directory.remove_step(evictable[0])
            log_event(log, "replica_evicted", snapshot_id=evictable[0].snapshot_id, for_snapshot=f"{job_id}/step-{step}")

    def _drop_abandoned(self) -> None:
        """Steps nobody wrote to for twice the I/O timeout: their sender is gone."""
        cutoff = time.monotonic() - 2 * IO_TIMEOUT_S
        with self._lock:
            stale = [(token, step) for token, step in self._steps.items() if step.touched < cutoff]
            for token, _ in stale:
                del self._steps[token]
        for _, step in stale:
            self.directory.discard(step.target)

    @staticmethod
    def _file_name(step: _Step, name: Any) -> str:
        rank = name[5:10] if isinstance(name, str) and name.startswith("rank-") else ""
        if not rank.isdigit() or int(rank) >= step.target.plan.world_size \
                or name not in (rank_data_name(int(rank)), rank_manifest_name(int(rank))):
            raise _Refusal("invalid", f"{str(name)[:60]!r} is not a rank file of this step")
        if name in step.received:
            raise _Refusal("invalid", f"{name} was received already")
        return name

    def _receive_file(self, conn: Connection, step: _Step, name: str) -> None:
        """Data frames into the file, until ``end`` names its size (its crc32 is checked against
        the rank's files, at ``finish_rank``)."""
        size = value = 0
        refused = None  # once refused, the frames are read to the end and dropped: the wire stays in step
        with self.directory.open_file(step.target, name) as sink:
            while True:
                frame = conn.receive_frame()
                if isinstance(frame, dict):
                    break
                if refused is None:
                    try:
                        self._reserve(step, len(frame))
                    except _Refusal as refusal:
                        refused, step.failed = refusal, step.failed or str(refusal)
                if refused is not None or step.failed:
                    continue
                with memoryview(frame) as view:
                    for placed in sink.put_pieces(view):
                        value = crc32(placed, value)
                size += len(frame)
            if refused is not None:
                raise refused
            if frame.get("op") != "end" or size != frame.get("bytes"):
                step.failed = f"{name} arrived with {size} bytes, not the {frame.get('bytes')} sent"
                raise _Refusal("corrupt", step.failed)
            sink.finish()
        step.received[name] = (size, value)

    def _check_received(self, step: _Step, files: tuple[FileRecord, ...]) -> None:
        for record in files:
            if step.received.get(record.name) != (record.bytes, record.crc32):
                step.failed = f"{record.name} is not here as its index lists it ({step.received.get(record.name)})"
                raise _Refusal("corrupt", step.failed)

    def _finish(self, conn: Connection, step: _Step, message: dict[str, Any]) -> None:
        layout = bytes(conn.receive_data(MAX_LAYOUT_BYTES)) if message.get("layout") else None
        try:
            index = SnapshotIndex.from_json(message.get("index"))
        except ValueError as exc:
            raise _Refusal("invalid", f"the step's index: {exc}") from None
        plan = step.target.plan
        if (index.job_id, index.step, index.world_size) != (plan.job_id, plan.step, plan.world_size):
            raise _Refusal("invalid", "the index names another step than the one prepared")
        self._check_received(step, index.files)
        if layout is not None and (index.layout is None or (len(layout), crc32(layout))
                                   != (index.layout.bytes, index.layout.crc32)):
            raise _Refusal("corrupt", "layout.json arrived unlike its index entry")
        index = dataclasses.replace(index, tenant=plan.tenant)  # the prepared tenant, whatever the index says
        result = self.directory.finish(step.target, index, layout)
        self._forget(step)
        self.directory.empty_trash(result)
        log_event(log, "replica_complete", snapshot_id=index.snapshot_id, ranks=list(index.ranks),
                  bytes=index.total_bytes)
        with self._lock:
            self.counters.update(complete=1, bytes=index.total_bytes)
        conn.send({"ok": True, "path": str(result.path)})

    def _forget(self, step: _Step) -> None:
        with self._lock:
            for token in [token for token, held in self._steps.items() if held is step]:
                del self._steps[token]
