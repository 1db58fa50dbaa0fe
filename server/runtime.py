"""Starting and stopping the server in-process (:func:`start_server` -> :class:`RunningServer`), for
the CLI, tests and the client's embedded mode. Start-up order matters: read the secrets, take the
socket path, bind (a second server on the same TCP port fails here), adopt or discard the segments
a previous server left, check the shm directory, then serve. Stop: health NOT_SERVING, streams end
with a notice, RPCs get ``shutdown_grace``, snapshots end, live sessions' segments stay for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import hashlib
import logging
import os
import pathlib
import secrets
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc

from swap_state.server.memory.adopt import adopt_segments, discard_segments
from swap_state.server.memory.arena import Arena
from swap_state.server.dir_trust import check_own_directory
from swap_state.server.memory.shm_dir import check_shm_dir, require_shm_dir
from swap_state.server.rpc.auth import CallerAuthInterceptor, read_token_file
from swap_state.server.tenants import ANYONE, Tenants, UidProofs, read_tenants_file
from swap_state.server.domain import StateServer
from swap_state.common.addresses import ListenAddress, parse_address
from swap_state.common.server_config import DirectIO, ServerConfig
from swap_state.common.sizes import format_size
from swap_state.common.errors import StartupError
from swap_state.server.rpc.listener import SocketGuard
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.logs import log_event
from swap_state.server.observability.metrics import MetricsServer, ServerCollector
from swap_state.server.rpc.service import SwapStateService
from swap_state.server.rpc.validation import validate_descriptor
from swap_state.server.snapshot.coordinator import SnapshotCoordinator
from swap_state.server.snapshot.group import RankRun
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.replica_receiver import ReplicaReceiver
from swap_state.server.snapshot.tiers.replica_wire import peer_credentials
from swap_state.server.memory.sessions import SessionRegistry
from swap_state.server.snapshot.tiers.spares import SpareFiles

__all__ = ["RunningServer", "SERVICE_NAME", "grpc_server_options", "start_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SwapState"].full_name  # "swap_state.v1.SwapState"


def grpc_server_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # An Allocate reply repeats the request's tensors with offsets: a bit larger.
        ("grpc.max_send_message_length", 2 * config.max_message_bytes),
        # Dead peers over TCP are noticed within ~30 s, so their sessions become orphaned.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        # Linux default is SO_REUSEPORT on: a second server on the same TCP port would bind
        # "successfully" and steal half the connections.
        ("grpc.so_reuseport", 0)]


@dataclasses.dataclass(eq=False)
class RunningServer:
    """A started server. ``address`` is a gRPC channel target (``unix:///...`` or host:port)."""

    config: ServerConfig
    address: str
    listen: ListenAddress
    socket_path: pathlib.Path | None
    metrics_address: tuple[str, int] | None
    arena: Arena
    sessions: SessionRegistry
    state: StateServer
    service: SwapStateService
    health: health_aio.HealthServicer
    _grpc: grpc.aio.Server
    _guard: SocketGuard | None
    _proofs: UidProofs | None
    _metrics: MetricsServer | None
    _stop_task: asyncio.Task[None] | None = None

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (idempotent); in-flight RPCs get ``grace`` seconds (``config.shutdown_grace``)."""
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._stop(grace))
        await asyncio.shield(self._stop_task)

    async def _stop(self, grace: float | None) -> None:
        grace = self.config.shutdown_grace if grace is None else grace
        log_event(log, "stopping", grace_seconds=grace, sessions=len(self.sessions.sessions))
        try:
            await self.health.enter_graceful_shutdown()
            self.sessions.begin_shutdown()
            await self._grpc.stop(grace)
            if self._metrics is not None:
                await self._metrics.stop()
            if self.state.snapshots is not None:
                # Let running snapshots finish (bounded) before their segments are freed.
                await asyncio.to_thread(self.state.snapshots.close)
            await self.state.drain(timeout_s=grace + 5.0)  # borrowed segments back
            await self.sessions.close(keep_segments=not self.config.free_segments_on_stop)
        finally:
            if self._guard is not None:
                self._guard.release()
            if self._proofs is not None:
                self._proofs.release()
            log_event(log, "stopped", budget_used=self.arena.used_bytes)


def _resolve_group(name: str | None, flag: str = "--shm-group") -> int | None:
    if name is None:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise StartupError(f"{flag} {name}: no such group") from None


def _read_tls(config: ServerConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    try:
        cert = config.tls_cert.read_bytes()
        key = config.tls_key.read_bytes()
        client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    except OSError as exc:
        raise StartupError(f"cannot read TLS file {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _prepare_snapshot_dir(path: pathlib.Path | None, gid: int | None) -> None:
    if path is None:
        return
    try:
        path.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"--snapshot-dir {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"--snapshot-dir {path} is not writable by this user")
    check_own_directory(path, "--snapshot-dir", shared_gid=gid)


def _segment_tag(listen: ListenAddress) -> str:
    # A tag of the address, so a restarted server finds what one on the same address left in
    # /dev/shm. An ephemeral TCP port has no stable identity: a random tag.
    if listen.scheme == "tcp" and listen.port == 0:
        return secrets.token_hex(6)
    return hashlib.sha256(listen.url.encode()).hexdigest()[:12]


def _bind(server: grpc.aio.Server, listen: ListenAddress, creds: grpc.ServerCredentials | None) -> int:
    target = listen.bind_target()
    try:
        if listen.scheme == "unix":
            # The socket must never be world-accessible, not even between bind and chmod.
            old = os.umask(0o117)
            try:
                port = server.add_insecure_port(target)
            finally:
                os.umask(old)
        elif creds is not None:
            port = server.add_secure_port(target, creds)
        else:
            port = server.add_insecure_port(target)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {listen.url}: {exc}") from None
    if listen.scheme == "tcp" and port == 0:
        raise StartupError(f"cannot listen on {listen.url} (address in use or not available)")
    return port


def _build_state(config: ServerConfig, listen: ListenAddress, gid: int | None,
                 undo: contextlib.AsyncExitStack) -> StateServer:
    """The server's state (the coordinator's close pushed on ``undo``)."""
    copy_policy = CopyBudgetPolicy(max_bandwidth=config.persist_max_bandwidth or None)
    arena = Arena(shm_dir=config.shm_dir, total_bytes=config.shm_size, cow_pool_bytes=config.cow_pool_bytes,
                  chunk_bytes=config.chunk_bytes, tag=_segment_tag(listen), gid=gid, mlock=config.mlock,
                  copy_policy=copy_policy, tenant_quota=config.tenant_shm_quota)
    registry = SessionRegistry(arena, grace=config.grace, stream_wait=config.stream_wait,
                               max_tensors=config.max_tensors)
    replicas = _memory_directory(config, listen, "replicas", "--replica-listen") if config.replica_listen else None
    memory = _memory_directory(config, listen, "memory", "--replica-peers") if config.replica_peers else None
    snapshots = None
    if config.snapshot_dir is not None:
        snapshots = SnapshotCoordinator(
            config.snapshot_dir, config.snapshot_settings, copy_policy=copy_policy, memory=memory,
            job_ranks=lambda job_id: {s.rank: RankRun((s.session_id, s.generation), s.last_committed_step,
                                              (s.world_size, s.local_world_size or s.world_size))
                                      for s in registry.sessions if s.job_id == job_id},
            replicas=replicas.reader if replicas is not None else None)
        undo.callback(snapshots.close)
    receiver = _start_replica_receiver(config, replicas, snapshots) if replicas is not None else None
    if receiver is not None:
        undo.callback(receiver.close)
    return StateServer(registry, snapshots, receiver)


def _memory_directory(config: ServerConfig, listen: ListenAddress, kind: str, flag: str) -> SnapshotDirectory:
    """Where peers' replicas (``kind`` "replicas") or this server's memory-only snapshots
    ("memory") are kept: under --shm-dir beside its segments, named after its address (a
    restarted server keeps them), with the spare files that new steps are written over (at most
    --replica-size of them for replicas; for memory-only snapshots, those of the last step removed)."""
    directory = SnapshotDirectory(config.shm_dir / f"swap-state-{kind}-{_segment_tag(listen)}", DirectIO.OFF)
    try:
        directory.create_root()
        if directory.hold():
            directory.clean_stale()
            directory.spares = SpareFiles(directory.root, config.replica_size if kind == "replicas" else None)
    except OSError as exc:
        raise StartupError(f"{flag}: cannot use {directory.root}: {exc.strerror or exc}") from None
    return directory


def _start_replica_receiver(config: ServerConfig, directory: SnapshotDirectory,
                            snapshots: SnapshotCoordinator | None) -> ReplicaReceiver:
    """``--replica-listen``: take peers' replicas into ``directory`` (memory)."""
    address = parse_address(config.replica_listen or "", "--replica-listen")
    receiver = ReplicaReceiver(address, peer_credentials(config.snapshot_settings), directory,
                               config.replica_size, snapshots.job_owner if snapshots is not None else lambda job: None,
                               snapshots.held if snapshots is not None else None)
    try:
        port = receiver.start()
    except OSError as exc:
        raise StartupError(f"--replica-listen {config.replica_listen}: {exc.strerror or exc}") from None
    log_event(log, "replica_listening", address=f"tcp://{address.host}:{port}", directory=str(directory.root),
              replica_size=config.replica_size, held=len(directory.reader.list()))
    return receiver


def _read_tenants(config: ServerConfig, listen: ListenAddress) -> Tenants:
    """``--tenants``, else ``--token-file``'s one token (one tenant with every right), else on
    a unix socket the caller's uid, else (tcp) one tenant."""
    if config.tenants is not None:
        return read_tenants_file(config.tenants)
    if config.token_file is not None:
        return Tenants({read_token_file(config.token_file): ANYONE})
    return Tenants(proofs=UidProofs(listen.path)) if listen.scheme == "unix" else Tenants()


def _prepare_shm(config: ServerConfig, state: StateServer, gid: int | None) -> None:
    """Adopt (or with ``--discard-segments`` remove) what a previous server on this address left,
    then check the shm directory holds the rest of the budget."""
    arena = state.arena
    require_shm_dir(config.shm_dir)
    check_own_directory(config.shm_dir, "--shm-dir", shared_gid=gid, sticky_ok=True)
    if config.discard_segments:
        removed, removed_bytes = discard_segments(arena)
        if removed:
            log_event(log, "leftover_segments_removed", logging.WARNING, files=removed,
                      bytes=removed_bytes, shm_dir=config.shm_dir)
    else:  # the sessions of the segments a previous server left, waiting for their trainers
        adopted, refused = adopt_segments(arena, lambda d: validate_descriptor(d, max_tensors=config.max_tensors))
        for item in refused:
            log_event(log, "segment_not_adopted", logging.WARNING, path=item.path, reason=item.reason,
                      detail="left where it is; remove it by hand, or start with --discard-segments")
        for item in adopted:
            state.registry.adopt(item)
            if state.snapshots is not None:
                state.snapshots.note_epoch(item.open_epoch)
        if adopted:
            log_event(log, "segments_adopted", sessions=len(adopted), bytes=arena.used_bytes, shm_dir=config.shm_dir)
    check_shm_dir(config.shm_dir, config.shm_size - arena.used_bytes)
    if arena.cow_pool_slots == 0:
        log_event(log, "cow_pool_empty", logging.WARNING, cow_budget=config.cow_pool_bytes,
                  chunk_bytes=config.chunk_bytes,
                  detail="no copy-before-write slots: snapshots will make the trainer wait "
                  "until each chunk is persisted")


async def _start_metrics(config: ServerConfig, service: SwapStateService, started_at: float) -> MetricsServer | None:
    """The ``--metrics-port`` endpoint, if any; StartupError (the registry closed) when it cannot listen."""
    if not config.metrics_port:
        return None
    state = service.state
    collector = ServerCollector(state.arena, state.registry, service.counters,
                                state.snapshot_counters, state.snapshots, state.replica_receiver, started_at=started_at)
    metrics = MetricsServer(collector, config.metrics_host, config.metrics_port)
    try:
        await metrics.start()
    except OSError as exc:
        await state.registry.close()
        raise StartupError(f"--metrics-port {config.metrics_host}:{config.metrics_port}: {exc.strerror}") from None
    return metrics


async def start_server(config: ServerConfig) -> RunningServer:
    """Start a server on ``config.listen`` (what a failed step leaves is undone); StartupError."""
    listen = parse_address(config.listen)
    tenants = _read_tenants(config, listen)
    gid = _resolve_group(config.shm_group)
    socket_gid = _resolve_group(config.socket_group, "--socket-group") if config.socket_group else gid
    creds = _read_tls(config)
    _prepare_snapshot_dir(config.snapshot_dir, gid)

    async with contextlib.AsyncExitStack() as undo:
        guard: SocketGuard | None = None
        if listen.scheme == "unix":
            assert listen.path is not None
            guard = SocketGuard(listen.path, shared_gid=socket_gid)
            guard.acquire()
            undo.callback(guard.release)
        if tenants.proofs is not None:
            tenants.proofs.prepare()  # beside the socket, in the directory the guard checked
        state = _build_state(config, listen, gid, undo)
        service = SwapStateService(state, keepalive_interval=config.keepalive_interval)
        health = health_aio.HealthServicer()
        interceptors = [CallerAuthInterceptor(tenants)] if tenants.enabled else []
        server = grpc.aio.server(interceptors=interceptors, options=grpc_server_options(config))
        pb_grpc.add_SwapStateServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = _bind(server, listen, creds)
        undo.push_async_callback(server.stop, None)
        if guard is not None:
            guard.bound()
        _prepare_shm(config, state, gid)

        await server.start()
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        state.registry.start()
        metrics = await _start_metrics(config, service, started_at=time.time())
        undo.pop_all()

    # The channel target of the bound address (a wildcard host becomes localhost).
    wildcard = listen.scheme == "tcp" and listen.host in ("0.0.0.0", "::", "")
    address = (dataclasses.replace(listen, host="localhost") if wildcard else listen).bind_target(port)
    running = RunningServer(config=config, address=address, listen=listen, socket_path=listen.path,
                            metrics_address=metrics.address if metrics else None, arena=state.arena,
                            sessions=state.registry, state=state, service=service, health=health, _grpc=server, _guard=guard,
                            _proofs=tenants.proofs, _metrics=metrics)
    auth = ("tenants" if config.tenants else "uid" if tenants.proofs is not None
            else "token" if tenants.enabled else "none")
    log_event(log, "started", listen=address if listen.scheme == "unix" else f"tcp://{address}",
              socket=listen.path or "", shm_dir=config.shm_dir, budget_bytes=config.shm_size,
              budget=format_size(config.shm_size), cow_pool_bytes=state.arena.cow_reserve_bytes,
              cow_slots=state.arena.cow_pool_slots, chunk_bytes=config.chunk_bytes, grace_seconds=config.grace,
              snapshot_dir=config.snapshot_dir or "", auth=auth, tls=creds is not None,
              metrics=f"{metrics.address[0]}:{metrics.address[1]}" if metrics and metrics.address else "off",
              pid=os.getpid())
    return running

