"""Prometheus metrics: collectors read the live domain objects at scrape time (no second bookkeeping that could drift),
registered on a private registry (never the process-global one: embedded servers and tests do not collide), served by a
tiny HTTP endpoint on the server's own event loop (``GET /metrics`` only; bounded request size and time).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from swap_state.server.memory.arena import Arena
from swap_state.server.logs import log_event
from swap_state.server.memory.session import Session, SessionState
from swap_state.server.memory.sessions import SessionRegistry
from swap_state.server.snapshot.coordinator import SnapshotCoordinator, SnapshotStatus
from swap_state.server.snapshot.tiers.replica_receiver import ReplicaReceiver

__all__ = ["CONTENT_TYPE", "MetricsServer", "RpcCounters", "ServerCollector", "SnapshotCounters"]

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # "text/plain; version=0.0.4; charset=utf-8"
_MAX_REQUEST_BYTES = 8192
_REQUEST_TIMEOUT = 5.0


class RpcCounters:
    """Calls per (method, status code) and their total seconds, counted by the RPC boundary."""

    def __init__(self) -> None:
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.calls[(method, code.name)] += 1
        self.seconds[method] += seconds


# Every counter's name ends in ``_total``: prometheus_client stores a counter without the
# suffix and renders ``<name>_total``, so the exposed name is exactly the one written here.
# (name, help, Arena attribute) of the arena's gauges, then of its counters.
_ARENA_GAUGES = (
    ("swap_state_budget_total_bytes", "The --shm-size budget.", "total_bytes"),
    ("swap_state_budget_used_bytes",
     "Bytes of all segment files (tensors, headers, padding, cow slots).", "used_bytes"),
    ("swap_state_budget_free_bytes", "Bytes a new segment may still take (the cow pool held back).", "free_bytes"),
    ("swap_state_cow_pool_slots", "Copy-before-write slots in the host pool.", "cow_pool_slots"),
    ("swap_state_cow_pool_slots_used", "Copy-before-write slots given to segments.", "cow_slots_used"))
_ARENA_COUNTERS = (
    ("swap_state_segment_allocations_total", "Segments created.", "allocations"),
    ("swap_state_segment_allocation_failures_total",
     "Segment creations refused (budget) or failed (shm full).", "allocation_failures"),
    ("swap_state_mlock_failures_total",
     "Segments that could not be mlock'd (RLIMIT_MEMLOCK / CAP_IPC_LOCK).", "mlock_failures"))
# (name, help, value of a Session) of the per-session gauges, labelled by job and rank (None: no sample).
_SESSION_GAUGES: tuple[tuple[str, str, Callable[[Session], float | None]], ...] = (
    ("swap_state_session_segment_bytes", "Segment bytes per session.",
     lambda s: s.segment.file_bytes if s.segment else 0),
    ("swap_state_session_model_area_bytes",
     "Bytes of each session's segment that are model tensors: the parameters and "
     "persistent buffers of whole-state snapshots (part of the segment bytes; 0 without).",
     lambda s: s.segment.model_bytes if s.segment else 0),
    ("swap_state_session_last_committed_step",
     "Last committed step per session (sessions with a committed step only).",
     lambda s: s.last_committed_step),
    ("swap_state_session_generation", "Current generation per session.", lambda s: s.generation))
# (name, help, SessionRegistry attribute) of the session counters.
_SESSION_COUNTERS = (
    ("swap_state_steps_committed_total", "Steps committed, all sessions.", "steps_committed_total"),
    ("swap_state_kept_states_dropped_total",
     "Reattached optimizer states a trainer dropped: not its parameters' state.",
     "kept_states_dropped_total"),
    ("swap_state_attaches_total", "Attach calls that succeeded.", "attaches"),
    ("swap_state_reattaches_total", "Attaches that got a kept session back.", "reattaches"),
    ("swap_state_sessions_freed_total", "Sessions freed (any reason).", "sessions_freed"),
    ("swap_state_sessions_expired_total", "Orphaned sessions freed after the grace period.", "sessions_expired"),
    ("swap_state_sessions_adopted_total", "Sessions adopted at start from a previous server's segments.",
     "sessions_adopted"),
    ("swap_state_session_reconnects_total",
     "KeepAlive streams trainers reopened without a new Attach (server restarted).", "reconnects"))


# (name, help, SnapshotCounters key) of the snapshot counters, then (name, help, uploader counters
# field) of the store's uploads.
_SNAPSHOT_COUNTERS = (
    ("swap_state_snapshots_started_total", "Snapshot ranks started.", "started"),
    ("swap_state_snapshots_durable_total", "Snapshot ranks made durable.", "durable"),
    ("swap_state_snapshots_failed_total", "Snapshot ranks that failed.", "failed"),
    ("swap_state_snapshot_bytes_total", "Bytes persisted by snapshots.", "bytes_persisted"),
    ("swap_state_snapshot_cow_copies_total", "Chunks copied before write while a snapshot persisted.", "cow_copies"),
    ("swap_state_snapshot_backpressure_waits_total", "Trainer waits for a free copy-before-write slot.",
     "backpressure_waits"),
    ("swap_state_snapshot_backpressure_wait_seconds_total",
     "Seconds trainers waited for a free copy-before-write slot.", "backpressure_wait_seconds"))
_UPLOAD_COUNTERS = (
    ("swap_state_store_ranks_stored_total", "Snapshot ranks put in the --snapshot-store.", "ranks_stored"),
    ("swap_state_store_ranks_failed_total", "Snapshot ranks whose upload failed.", "ranks_failed"),
    ("swap_state_store_bytes_total", "Bytes uploaded to the --snapshot-store.", "bytes_stored"),
    ("swap_state_store_upload_seconds_total", "Seconds spent uploading snapshots.", "seconds"))
_REPLICA_COUNTERS = (
    ("swap_state_replicas_sent_total", "Snapshots replicated into a --replica-peers peer.", "replicated"),
    ("swap_state_replicas_failed_total", "Snapshots whose replica failed (the snapshot stayed durable).", "failed"),
    ("swap_state_replica_sent_bytes_total", "Bytes of the snapshots replicated.", "bytes"))
_RECEIVER_COUNTERS = (
    ("swap_state_replicas_received_total", "Replicas peers sent here (--replica-listen), complete.", "complete"),
    ("swap_state_replica_received_bytes_total", "Bytes of the replicas received complete.", "bytes"),
    ("swap_state_replica_connections_refused_total",
     "Connections to --replica-listen refused: a wrong secret or certificate, or another protocol.", "refused"))
_SUMMED = ("bytes_persisted", "cow_copies", "backpressure_waits", "backpressure_wait_seconds")


class SnapshotCounters(collections.Counter):
    """Totals of the snapshot ranks (keys: ``_SNAPSHOT_COUNTERS``' own), for the metrics endpoint:
    "started" counted by the Snapshot RPC, the others by :meth:`record` once a rank settled."""

    def record(self, status: SnapshotStatus) -> None:
        self["durable" if status.state.value in ("durable", "stored") else "failed"] += 1
        for name in _SUMMED:
            self[name] += getattr(status, name)


class ServerCollector(Collector):
    """Every family of the server, read from the live objects on every ``collect()``."""

    def __init__(self, arena: Arena, registry: SessionRegistry, counters: RpcCounters,
                 snapshot_counters: SnapshotCounters, coordinator: SnapshotCoordinator | None,
                 receiver: ReplicaReceiver | None = None, *, started_at: float) -> None:
        self.arena, self.registry, self.counters = arena, registry, counters
        self.snapshot_counters, self.coordinator, self.started_at = snapshot_counters, coordinator, started_at
        self.receiver = receiver

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("swap_state_up", "1 while the server serves.", 1)
        yield GaugeMetricFamily("swap_state_start_time_seconds", "Unix time the server started.", self.started_at)
        for name, help_text, attr in _ARENA_GAUGES:
            yield GaugeMetricFamily(name, help_text, getattr(self.arena, attr))
        for name, help_text, attr in _ARENA_COUNTERS:
            yield CounterMetricFamily(name, help_text, getattr(self.arena, attr))
        sessions = self.registry.sessions
        by_state = GaugeMetricFamily("swap_state_sessions", "Sessions by state.", labels=["state"])
        for state in SessionState:
            by_state.add_metric([state.value], sum(1 for s in sessions if s.state is state))
        yield by_state
        for name, help_text, value in _SESSION_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["job_id", "rank"])
            for s in sessions:
                if (v := value(s)) is not None:
                    family.add_metric([s.job_id, str(s.rank)], v)
            yield family
        for name, help_text, attr in _SESSION_COUNTERS:
            yield CounterMetricFamily(name, help_text, getattr(self.registry, attr))
        calls = CounterMetricFamily("swap_state_rpc_total", "RPCs by method and status code.",
                                    labels=["method", "code"])
        for (method, code), n in sorted(self.counters.calls.items()):
            calls.add_metric([method, code], n)
        yield calls
        seconds = CounterMetricFamily("swap_state_rpc_seconds_total", "Seconds spent in RPCs by method.",
                                      labels=["method"])
        for method, spent in sorted(self.counters.seconds.items()):
            seconds.add_metric([method], spent)
        yield seconds
        running = self.coordinator.in_progress() if self.coordinator is not None else []
        yield GaugeMetricFamily("swap_state_snapshots_in_progress", "Snapshot ranks persisting now.", len(running))
        for name, help_text, field in _SNAPSHOT_COUNTERS:
            yield CounterMetricFamily(name, help_text, self.snapshot_counters[field])
        uploader = self.coordinator.uploader if self.coordinator is not None else None
        if uploader is not None:
            for name, help_text, field in _UPLOAD_COUNTERS:
                yield CounterMetricFamily(name, help_text, getattr(uploader.counters, field))
        yield from self._replicas()

    def _replicas(self) -> Iterator[Metric]:
        """The replicas this server sends (--replica-peers) and those it holds (--replica-listen)."""
        states = self.coordinator.replica_states if self.coordinator is not None else None
        if states is not None:
            for name, help_text, key in _REPLICA_COUNTERS:
                yield CounterMetricFamily(name, help_text, states.counters[key])
        if self.receiver is not None:
            yield GaugeMetricFamily("swap_state_replica_size_bytes", "The --replica-size budget.", self.receiver.size)
            yield GaugeMetricFamily("swap_state_replica_held_bytes",
                                    "Bytes of --replica-size held: replicas, spares and those arriving.",
                                    self.receiver.held_bytes())
            for name, help_text, key in _RECEIVER_COUNTERS:
                yield CounterMetricFamily(name, help_text, self.receiver.counters[key])


class MetricsServer:
    """``GET /metrics`` on host:port: the collector's families (text format 0.0.4), a private registry."""

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        self._metrics = CollectorRegistry(auto_describe=False)
        self._metrics.register(collector)
        self._host, self._port = host, port
        self._server: asyncio.base_events.Server | None = None
        self.address: tuple[str, int] | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port, reuse_address=True)
        sock = self._server.sockets[0].getsockname()
        self.address = (sock[0], sock[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT)
            if len(head) > _MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method not in ("GET", "HEAD"):
                status, data, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
            elif target.split("?", 1)[0] != "/metrics":
                status, data, ctype = "404 Not Found", b"try /metrics\n", "text/plain"
            else:
                status, data, ctype = "200 OK", generate_latest(self._metrics), CONTENT_TYPE
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                         "Connection: close\r\n\r\n".encode())
            if method != "HEAD":
                writer.write(data)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError, ConnectionError):
            pass  # a broken scrape is the scraper's problem, never the server's
        except Exception:
            log_event(log, "metrics_error", logging.ERROR, exc_info=True)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
