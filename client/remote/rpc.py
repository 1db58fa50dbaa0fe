"""The trainer's gRPC client for swap-state-server: one method per RPC, each with a deadline.

Call order::

    client = SwapStateClient(ClientConfig(address, token=...))
    session = client.attach(job_id, rank, world_size)   # starts the keep-alive stream
    session.allocate(specs); session.header = mapping.trainer   # commits need no RPC
    session.commit(step)                                 # per step (header words)
    session.snapshot(step, ...)                          # optional, between steps
    session.close(keep=False); client.close()

A broken keep-alive stream (the server died or stops) *disconnects* the session: steps go on,
the keep-alive thread reconnects. A call that a restart cuts or meets (UNAVAILABLE, or CANCELLED
by a stopping server) rides through it: the calls in :data:`RIDES_THROUGH` are tried again
against the successor for up to ``ClientConfig.server_wait_s``, then raise
:class:`ServerUnavailableError`. The session is *lost* (:class:`SessionLostError`) only when a
server answers that it does not hold it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import grpc

from swap_state.common.addresses import parse_address
from swap_state.common.caller_proof import CallerProof
from swap_state.common.errors import SERVER_STOPPING_NOTICE, ConfigError
from swap_state.common.retry import wait_until
from swap_state.client.remote.environment import (
    ENV_SERVER, ENV_SERVER_UID, ENV_TLS, server_from_env, server_uid_from_env, tls_file_from_env, token_file_from_env)
from swap_state.client.errors import (
    ServerUnavailableError, SessionLostError, SnapshotFailedError, StaleGenerationError, SwapStateError,
    error_for, reason_of)
from swap_state.common.segment import Word, tensor_nbytes
from swap_state.common.trainer_header import TrainerHeader
from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc

__all__ = [
    "ClientConfig", "SwapStateError", "ServerUnavailableError", "SessionLostError", "SwapStateClient",
    "RemoteSession", "SnapshotHandle", "normalize_target", "start_hint"]

log = logging.getLogger(__name__)

def start_hint(address: str, shm_dir: str = "/dev/shm") -> str:
    """How to start a server at ``address`` here: a ``--shm-size`` that fits ``shm_dir``, and
    ``--insecure`` for a tcp address (a server refuses tcp without TLS or it)."""
    try:
        stat = os.statvfs(shm_dir)
        total = stat.f_frsize * stat.f_blocks
    except OSError:
        total = 0
    if total >= 128 << 30 or total == 0:
        size, why = "64G", ""
    elif total >= 2 << 30:
        size, why = f"{total // 2 >> 30}G", f" (half of this host's {shm_dir}: size it to the moments, 8 bytes per parameter of every rank on the host)"
    else:
        size, why = f"{max(64, total // 2 >> 20)}M", f" (half of this host's {shm_dir})"
    tls = " --insecure" if address.startswith("tcp://") else ""
    return f"start one with: swap-state-server --shm-size {size} --listen {address}{tls}{why}"


# CANCELLED without a reason: a stopping server cancelled the call (no client call is cancelled).
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
#: The calls tried again when a server restart cuts them: each is a retry the server recognises
#: (a Snapshot of the same run and step returns the same handle) or only reads. Attach waits for
#: the server itself; Allocate, Restore and CommitStep are not retried: each changes the segment,
#: and an attempt the old server began is the successor's to adopt or refuse.
RIDES_THROUGH = frozenset({"Snapshot", "SnapshotStatus", "ListSnapshots", "Stats", "Detach"})
#: A detach that fails costs nothing but memory until the server's --grace: a trainer exiting
#: while its server is gone for good waits this long at most, not server_wait_s.
DETACH_WAIT_S = 5.0
#: How long a missing unix socket may take to appear (a server started just before the trainer; a server in another
#: container is waited for by its health check, not by this): short, so that a wrong path fails within seconds of the
#: trainer's start (a trainer restarted beside a restarting server is the rarer case; its scheduler restarts it again).
SOCKET_APPEAR_S = 1.5
_POLLER_SETTLE_S = 0.25
# grpc's channel backoff (2 min by default) and the keep-alive's stay short: a restarted
# server is found within about a second.
_RECONNECT_FIRST_S = 0.05
_RECONNECT_MAX_S = 1.0
# An Allocate's deadline: 60 s plus this rate per byte (a VM's first-touch memory: 0.4 GiB/s).
_SLOWEST_ALLOCATE_BYTES_PER_S = 128 << 20
_CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(_RECONNECT_MAX_S * 1000))]


@dataclasses.dataclass
class ClientConfig:
    """How a process reaches its server (the trainer's :class:`RemoteConfig` adds the job's
    settings). A field left None is read from the environment when the client is made."""

    server: str | None = None
    """``unix:///path/to/sock``, a bare socket path, or ``tcp://host:port``; None: $SWAP_STATE_SERVER
    (a trainer then looks for the host's server at the default socket, else starts an embedded one)."""
    token: str | None = None
    """Shared secret sent as ``authorization: Bearer`` (the server's --token-file); None: the
    contents of $SWAP_STATE_TOKEN_FILE when set."""
    server_uid: int | None = None
    """The uid owning a unix:// server's socket when neither yours nor root's (others are
    refused); None: $SWAP_STATE_SERVER_UID."""
    tls_root_cert: str | None = None
    """PEM roots of a tcp:// server's certificate; None: $SWAP_STATE_TLS_ROOT_CERT, else no TLS."""
    tls_client_cert: str | None = None
    """PEM certificate for a server with --tls-client-ca; None: $SWAP_STATE_TLS_CLIENT_CERT."""
    tls_client_key: str | None = None
    """PEM file of that certificate's private key; None: $SWAP_STATE_TLS_CLIENT_KEY."""
    rpc_timeout_s: float = 10.0
    """Deadline of every control RPC."""
    connect_timeout_s: float = 10.0
    """How long attach waits for an unreachable server before failing."""
    server_wait_s: float = 60.0
    """How long a call in :data:`RIDES_THROUGH` (a snapshot, a wait on one, a listing, Stats, the detach) is tried again
    while the server is unreachable (restarting); 0: it fails at once. Steps never wait for the server."""


def _read_tls_files(config: ClientConfig) -> dict[str, bytes | None]:
    """Each TLS file of ``config`` (else its environment variable's), read."""
    out: dict[str, bytes | None] = {}
    for field in ENV_TLS:
        path = getattr(config, field) or tls_file_from_env(field)
        try:
            out[field] = open(path, "rb").read() if path else None
        except OSError as exc:
            raise ValueError(f"cannot read the TLS file {path} ({field}, ${ENV_TLS[field]}): {exc.strerror}") from None
    if (out["tls_client_cert"] is None) != (out["tls_client_key"] is None):
        raise ValueError("a TLS client certificate and its key go together (tls_client_cert, tls_client_key)")
    return out


def normalize_target(address: str) -> str:
    """A user-facing address (the server's ``--listen`` rules) as a gRPC target string."""
    try:
        return parse_address(address, flag="swap-state server address").bind_target()
    except ConfigError as e:
        raise SwapStateError(f"{e} (set --optimizer.swap_state_server or SWAP_STATE_SERVER)") from e


class SwapStateClient:
    """A channel to one swap-state-server; thread-safe; cheap to keep for the process."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self.address = config.server or server_from_env() or ""
        if not self.address:
            raise SwapStateError(f"no swap-state-server address: set ${ENV_SERVER} or pass one (RemoteConfig.server; "
                                 "torchtitan: --optimizer.swap_state_server; the CLI: --server)")
        self.target = normalize_target(self.address)
        self._socket_path = (self.target.removeprefix("unix://").removeprefix("unix:")
                             if self.target.startswith("unix:") else None)
        self.server_uid = config.server_uid if config.server_uid is not None else server_uid_from_env()
        tls = _read_tls_files(config)
        if tls["tls_root_cert"] is not None:
            creds = grpc.ssl_channel_credentials(tls["tls_root_cert"], tls["tls_client_key"], tls["tls_client_cert"])
            self._channel = grpc.secure_channel(self.target, creds, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.SwapStateStub(self._channel)
        self._ready_at = float("-inf")
        token = config.token
        if token is None and (path := token_file_from_env()):
            with open(path) as f:
                token = f.read().strip()
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._proof: CallerProof | None = None  # this process's uid proof, once made
        self._proof_lock = threading.Lock()

    def call(self, name: str, request, timeout_s: float | None = None, server_wait_s: float | None = None):
        """Invoke unary RPC ``name`` with the deadline and error mapping every call gets. A call
        in :data:`RIDES_THROUGH` is tried again while the server is unreachable, for up to
        ``server_wait_s`` (default ``config.server_wait_s``)."""
        self._prove_uid()
        timeout = timeout_s or self.config.rpc_timeout_s
        wait_s = self.config.server_wait_s if server_wait_s is None else server_wait_s
        wait_s = wait_s if name in RIDES_THROUGH else 0.0
        deadline = time.monotonic() + wait_s
        delay = _RECONNECT_FIRST_S
        while True:
            try:
                return getattr(self._stub, name)(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                error = self._translate(name, e)
                cause = e
            left = deadline - time.monotonic()
            if not isinstance(error, ServerUnavailableError) or left <= 0:
                if wait_s > 0 and isinstance(error, ServerUnavailableError):
                    error = ServerUnavailableError(f"{error} (tried again for {wait_s:g} s: "
                                                   "RemoteConfig.server_wait_s)", error.code)
                raise error from cause
            if delay == _RECONNECT_FIRST_S:
                log.warning("%s: swap-state-server at %s is unreachable (a restart?): trying again for up to "
                            "%.0f s", name, self.address, left)
            time.sleep(min(delay, left))
            delay = min(2 * delay, _RECONNECT_MAX_S)
            self._prove_uid()  # a server just started may have made its callers' directory since

    def _translate(self, name: str, e: grpc.RpcError) -> SwapStateError:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        where = f"swap-state-server at {self.address}"
        reason = reason_of(e)
        if code in _UNREACHABLE and reason is None:  # with a reason, the server answered
            return ServerUnavailableError(f"{name}: {where} is not reachable ({code.name}: {details}); "
                                          f"{start_hint(self.address)}", code)
        code_name = code.name if code is not None else "UNKNOWN"
        return error_for(reason, f"{name} failed at {where}: {code_name}: {details}", code)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until the channel is ready; nothing (a token, an Attach) goes to another user's socket."""
        timeout_s = timeout_s or self.config.connect_timeout_s
        path = self._socket_path
        appear_s = min(SOCKET_APPEAR_S, self.config.connect_timeout_s)
        if path is not None and not wait_until(lambda: os.path.exists(path), timeout_s=appear_s, first_s=0.05):
            raise ServerUnavailableError(
                f"no swap-state-server at {self.address}: there is no socket file {path}. Is the "
                "server running, and listening there? Point the trainer at the path it listens on "
                f"(RemoteConfig.server, $SWAP_STATE_SERVER, torchtitan optimizer.swap_state_server), or "
                f"{start_hint(self.address)}", grpc.StatusCode.UNAVAILABLE)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError as e:
            raise ServerUnavailableError(
                f"swap-state-server at {self.address} is not reachable after {timeout_s:.0f}s; "
                f"{start_hint(self.address)}", grpc.StatusCode.UNAVAILABLE) from e
        if path is not None:
            try:
                owner = os.stat(path).st_uid
            except OSError:
                owner = os.getuid()  # gone between connect and here: the call itself will say so
            if owner not in {os.getuid(), 0, self.server_uid}:  # server_uid None matches no owner
                raise SwapStateError(
                    f"refusing to talk to {self.address}: the socket belongs to uid {owner}, not to "
                    f"you (uid {os.getuid()}) or root, so another user may have taken its path. If that user "
                    f"runs your server, say so: ClientConfig.server_uid / ${ENV_SERVER_UID}={owner}")
        self._prove_uid()
        self._ready_at = time.monotonic()

    def _prove_uid(self) -> None:
        """The proof file of this process's uid, named in every later call; tried again before
        each call until made (a server not started yet, or without uid tenants, has no
        directory for it: one failed ``open``, microseconds beside a call)."""
        path = self._socket_path
        if path is None or self._proof is not None:
            return
        with self._proof_lock:  # the keep-alive thread calls too
            if self._proof is not None:
                return
            proof = CallerProof(path)
            if proof.create():
                self._metadata = (*self._metadata, proof.metadata)
                self._proof = proof

    def attach(self, job_id: str, rank: int, world_size: int, local_world_size: int = 0) -> RemoteSession:
        """Attach (job_id, rank). ``local_world_size``: the job's ranks on this server (0: all);
        the server completes a snapshot once that many ranks have persisted it."""
        self.wait_ready()
        reply = self.call("Attach", pb.AttachRequest(
            job_id=job_id, rank=rank, world_size=world_size, local_world_size=local_world_size,
            client_pid=os.getpid(), client_host=socket.gethostname()))
        return RemoteSession(self, job_id, rank, world_size, reply, local_world_size=local_world_size or world_size)

    def stats(self, server_wait_s: float | None = None) -> pb.StatsReply:
        """The server's Stats; an unreachable server is tried for ``server_wait_s`` (default
        ``config.server_wait_s``; 0 for an answer now or an error)."""
        return self.call("Stats", pb.StatsRequest(), server_wait_s=server_wait_s)

    def list_snapshots(self, job_id: str = "") -> pb.ListSnapshotsReply:
        return self.call("ListSnapshots", pb.ListSnapshotsRequest(job_id=job_id))

    def snapshot_status(self, snapshot_id: str, rank: int, wait_s: float = 0.0, wait_stored: bool = False,
                        server_wait_s: float | None = None, wait_replicated: bool = False) -> pb.SnapshotStatusReply:
        """``wait_s``: how long the server waits for a terminal state (``wait_stored``,
        ``wait_replicated``: past durable, for the store, the peer); ``server_wait_s``: how long
        an unreachable server is tried again (default ``config.server_wait_s``)."""
        request = pb.SnapshotStatusRequest(snapshot_id=snapshot_id, rank=rank, wait_seconds=wait_s,
                                           wait_stored=wait_stored, wait_replicated=wait_replicated)
        return self.call("SnapshotStatus", request, timeout_s=self.config.rpc_timeout_s + wait_s,
                         server_wait_s=server_wait_s)

    def open_keepalive(self, session_id: str, generation: int):
        """The server-streaming KeepAlive call; long deadline, renewed by the caller."""
        request = pb.KeepAliveRequest(session_id=session_id, generation=generation)
        self._prove_uid()
        return self._stub.KeepAlive(request, timeout=24 * 3600, metadata=self._metadata)

    def close(self) -> None:
        # grpc's connectivity poller (started by wait_ready) notices its unsubscription only
        # after up to 0.2 s; closing the channel before that makes it die with a traceback.
        time.sleep(max(0.0, _POLLER_SETTLE_S - (time.monotonic() - self._ready_at)))
        self._channel.close()
        if self._proof is not None:
            self._proof.remove()


@dataclasses.dataclass
class SnapshotHandle:
    """A snapshot in progress (``c.snapshot()`` returns once it is consistent): wait until it is
    durable, or in the store."""

    snapshot_id: str
    step: int
    rank: int
    client: SwapStateClient

    def status(self, wait_s: float = 0.0, wait_stored: bool = False, server_wait_s: float | None = None):
        return self.client.snapshot_status(self.snapshot_id, self.rank, wait_s, wait_stored, server_wait_s)

    def wait_durable(self, timeout_s: float = 600.0):
        """The status once durable (or stored); SnapshotFailedError if it failed, TimeoutError."""
        return self._wait(timeout_s, "durable")

    def wait_stored(self, timeout_s: float = 600.0):
        """The status once this rank's files are in the ``--snapshot-store``; SwapStateError
        when the upload failed or there is no store; TimeoutError."""
        return self._wait(timeout_s, "stored")

    def wait_replicated(self, timeout_s: float = 600.0):
        """The status once the snapshot is in a peer server's memory (its ``--replica-peers``);
        SwapStateError when its replica failed or the server has no peers; TimeoutError."""
        return self._wait(timeout_s, "replicated")

    def _wait(self, timeout_s: float, goal: str):
        """Poll until ``goal``: durable, or past it the store's or the peer's (:data:`_TIERS`) state."""
        tier, none = _TIERS.get(goal, ("", ""))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            reply = self.client.snapshot_status(self.snapshot_id, self.rank, max(0.0, min(remaining, 5.0)),
                                                wait_stored=goal == "stored", wait_replicated=goal == "replicated")
            if reply.state == "failed":
                raise SnapshotFailedError(f"snapshot {self.snapshot_id} failed: {reply.error}")
            if reply.state in ("durable", "stored"):
                if not tier or getattr(reply, f"{tier}_state") == goal:
                    return reply
                if getattr(reply, f"{tier}_state") in ("", "failed"):
                    why = getattr(reply, f"{tier}_error") or none
                    raise SwapStateError(f"snapshot {self.snapshot_id} is durable but not {goal}: {why}")
            if remaining <= 0:
                done = reply.bytes_stored if goal == "stored" else reply.bytes_persisted
                raise TimeoutError(f"snapshot {self.snapshot_id} not {goal} after {timeout_s}s "
                                   f"({done}/{reply.bytes_total} bytes)")


#: Per goal of :meth:`SnapshotHandle._wait` past durable: its reply fields' prefix, what an empty state means.
_TIERS = {"stored": ("store", "the server has no --snapshot-store"),
          "replicated": ("replica", "the server has no --replica-peers")}

#: What a trainer whose KeepAlive stream failed should do next, by the stream's status code.
_LOST_NEXT = {
    grpc.StatusCode.NOT_FOUND: "restart the trainer and restore a snapshot (--resume latest in "
    "the demo, container.restore('latest')), or give the server a longer --grace",
    None: "the optimizer state on the server may be gone: restore from a snapshot after "
    "restarting the server"}


class RemoteSession:
    """One attached (job_id, rank) session; owns the keep-alive thread."""

    def __init__(self, client: SwapStateClient, job_id: str, rank: int, world_size: int,
                 reply: pb.AttachReply, *, local_world_size: int = 0):
        self.client = client
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size or world_size
        self.session_id = reply.session_id
        self.generation = reply.generation
        self.previous_session: str = reply.previous_session
        """Not reattached: why the server holds no state for this job/rank, when it knows."""
        self.segment: pb.SegmentInfo | None = reply.segment if reply.has_segment else None
        self.last_committed_step: int | None = reply.last_committed_step if reply.has_committed_step else None
        self._lost: SwapStateError | None = None
        self._connected = threading.Event()
        self._connected.set()  # attached just now
        self._disconnected_at = 0.0
        self.reconnects = 0  # times the keep-alive came back after the server was unreachable
        self.header: TrainerHeader | None = None
        """The mapped segment's header, committed through (no RPC per step); None before unmapping."""
        self._closing = threading.Event()
        self._stream = None
        self._thread = threading.Thread(target=self._keepalive_loop, name=f"swap-state-keepalive-{rank}", daemon=True)
        self._thread.start()

    def _keepalive_loop(self) -> None:
        delay = _RECONNECT_FIRST_S
        while not self._closing.is_set():
            outcome = self._follow_stream()
            if outcome == "stop":
                return
            if outcome == "connected":
                delay = _RECONNECT_FIRST_S
            elif self._closing.wait(delay):  # "gone": try again after a while
                return
            else:
                delay = min(2 * delay, _RECONNECT_MAX_S)

    def _follow_stream(self) -> str:
        """Open the KeepAlive stream and follow it until it ends: "stop" (closing, or the
        session is lost), "connected" (to renew after events came), "gone" (no server)."""
        try:
            stream = self._stream = self.client.open_keepalive(self.session_id, self.generation)
        except ValueError:  # grpc: "Channel closed!": the client was closed under the session
            return "stop"
        if self._closing.is_set():  # close() ran between the check and the open
            stream.cancel()
        notice = ""
        try:
            for event in stream:
                if not self._connected.is_set():
                    self.reconnects += 1
                    down = time.monotonic() - self._disconnected_at
                    log.warning("swap-state-server at %s is back after %.1f s: session %s/rank %d "
                                "reconnected (reconnect %d)", self.client.address, down, self.job_id,
                                self.rank, self.reconnects)
                    self._connected.set()
                if event.notice:
                    notice = event.notice
                    log.info("swap-state-server: %s", event.notice)
        except grpc.RpcError as e:
            if self._closing.is_set():
                return "stop"
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "connected"  # the 24 h stream deadline: renew
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                return self._mark_gone(f"{e.code().name}: {e.details()}")
            self._lose(e.code(), f"{e.code().name}: {e.details()}")
            return "stop"
        if self._closing.is_set():
            return "stop"
        if notice == SERVER_STOPPING_NOTICE:
            return self._mark_gone("the server is stopping (a restart or an upgrade?)")
        self._lose(None, "the server closed the session")
        return "stop"

    def _lose(self, code: grpc.StatusCode | None, why: str) -> None:
        """The server answered that it does not hold the session (any more)."""
        after = (" after the server restarted: the new server did not adopt this session's segment (started with "
                 "--discard-segments, or the segment failed its checks: see the server's log)"
                 if self.server_gone() else "")
        self._lost = SessionLostError(f"lost the swap-state session {self.job_id}/rank {self.rank} at "
                                      f"{self.client.address}{after}: {why}; "
                                      f"{_LOST_NEXT.get(code, _LOST_NEXT[None])}", code)

    def _mark_gone(self, why: str) -> str:
        if self._connected.is_set():
            self._connected.clear()
            self._disconnected_at = time.monotonic()
            log.warning("swap-state-server at %s is unreachable (%s): training goes on (steps need no "
                        "server); snapshots and restores fail until it is back; reconnecting",
                        self.client.address, why)
        return "gone"

    def server_gone(self) -> bool:
        """Whether the server is unreachable now (the keep-alive thread reconnects)."""
        return not self._connected.is_set()

    def check_alive(self) -> None:
        """Raise the keep-alive failure, if any (cheap; called before each step)."""
        if self._lost is not None:
            raise self._lost

    def _call(self, name: str, request, timeout_s: float | None = None):
        try:
            return self.client.call(name, request, timeout_s)
        except ServerUnavailableError:
            raise
        except SwapStateError:
            self.check_alive()  # a lost session explains the failure better
            raise

    def allocate(self, specs: Sequence[tuple[str, str, Sequence[int]]]) -> pb.AllocateReply:
        """Allocate the segment; the deadline follows the size (the server mlocks every page)."""
        tensors = [pb.TensorSpec(name=n, dtype=d, shape=list(s)) for n, d, s in specs]
        request = pb.AllocateRequest(session_id=self.session_id, generation=self.generation, tensors=tensors)
        nbytes = sum(tensor_nbytes(d, s) for _, d, s in specs)
        deadline = max(60.0 + nbytes / _SLOWEST_ALLOCATE_BYTES_PER_S, self.client.config.rpc_timeout_s)
        reply = self._call("Allocate", request, timeout_s=deadline)
        self.segment = reply.segment
        return reply

    def commit(self, step: int) -> int:
        """Commit ``step`` (its writes are complete); refused when another trainer took the
        segment over. A trainer's segment is mapped: header words, no RPC. The CommitStep RPC
        is for a session whose segment this process does not map (admin tools, test kits)."""
        self.check_alive()
        header = self.header
        if header is None:
            request = pb.CommitStepRequest(session_id=self.session_id, generation=self.generation, step=step)
            self.last_committed_step = self._call("CommitStep", request).committed_step
            return self.last_committed_step
        if header[Word.TRAINER_GENERATION] != self.generation:
            raise StaleGenerationError(
                f"job {self.job_id} rank {self.rank} was re-attached by another trainer (generation "
                f"{header[Word.TRAINER_GENERATION]}, this one {self.generation}): this trainer must stop")
        header.commit(step)
        self.last_committed_step = step
        return step

    def snapshot(self, step: int, keep_latest: int = 0, keep_all: bool = False, replace_existing: bool = False,
                 memory_only: bool = False, **metadata_parts: str) -> pb.SnapshotReply:
        """Snapshot committed ``step`` with the job's retention (``memory_only``: see
        ``SnapshotRequest``). ``metadata_parts``: ``metadata_base_id``/``_base_json``/``_delta_json``."""
        self.check_alive()
        request = pb.SnapshotRequest(
            session_id=self.session_id, generation=self.generation, step=step, keep_latest=keep_latest,
            keep_all=keep_all, replace_existing=replace_existing, memory_only=memory_only, **metadata_parts)
        return self._call("Snapshot", request)

    def restore(self, snapshot_id: str = "latest", metadata_json: str = "") -> pb.RestoreReply:
        """``metadata_json``: this rank's layout, so the server can reshard to it."""
        request = pb.RestoreRequest(session_id=self.session_id, generation=self.generation,
                                    snapshot_id=snapshot_id, metadata_json=metadata_json)
        return self._call("Restore", request, timeout_s=max(300.0, self.client.config.rpc_timeout_s))

    def close(self, keep: bool = False) -> None:
        """Detach (free the segment unless ``keep``) and stop the keep-alive stream."""
        if self._closing.is_set():
            return
        try:
            if self._lost is None:
                request = pb.DetachRequest(session_id=self.session_id, generation=self.generation, keep=keep)
                self.client.call("Detach", request, server_wait_s=min(DETACH_WAIT_S, self.client.config.server_wait_s))
        finally:
            self._closing.set()
            if self._stream is not None:
                self._stream.cancel()
            self._thread.join(timeout=5.0)
