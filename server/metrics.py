"""Prometheus metrics: the text exposition format (0.0.4), served over plain asyncio HTTP.

Values are read from the domain objects at scrape time (no second bookkeeping that could
drift). The HTTP side is deliberately tiny: ``GET /metrics`` only, bounded request size and
time, one response per connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable

from .arena import Arena
from .logs import log_event
from .sessions import SessionRegistry, SessionState
from .statuses import RpcCounters

__all__ = ["CONTENT_TYPE", "MetricsServer", "render_metrics"]

log = logging.getLogger("swap_state.server.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_REQUEST_BYTES = 8192
_REQUEST_TIMEOUT = 5.0


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, object], float]],
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if labels:
                rendered = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
                self.lines.append(f"{name}{{{rendered}}} {_number(value)}")
            else:
                self.lines.append(f"{name} {_number(value)}")

    def one(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.family(name, kind, help_text, [({}, value)])


def render_metrics(
    arena: Arena,
    registry: SessionRegistry,
    counters: RpcCounters,
    *,
    started_at: float,
    extra: Iterable[Callable[[_Writer], None]] = (),
) -> str:
    out = _Writer()
    out.one("swap_state_up", "gauge", "1 while the server serves.", 1)
    out.one("swap_state_start_time_seconds", "gauge", "Unix time the server started.", started_at)
    out.one("swap_state_budget_total_bytes", "gauge", "The --shm-size budget.", arena.total_bytes)
    out.one("swap_state_budget_used_bytes", "gauge",
            "Bytes of all segment files (tensors, headers, padding, cow slots).", arena.used_bytes)
    out.one("swap_state_budget_free_bytes", "gauge",
            "Bytes a new segment may still take (the cow pool held back).", arena.free_bytes)
    out.one("swap_state_cow_pool_slots", "gauge", "Copy-before-write slots in the host pool.",
            arena.cow_pool_slots)
    out.one("swap_state_cow_pool_slots_used", "gauge", "Copy-before-write slots given to segments.",
            arena.cow_slots_used)
    out.one("swap_state_segment_allocations_total", "counter", "Segments created.", arena.allocations)
    out.one("swap_state_segment_allocation_failures_total", "counter",
            "Segment creations refused (budget) or failed (shm full).", arena.allocation_failures)
    out.one("swap_state_mlock_failures_total", "counter",
            "Segments that could not be mlock'd (RLIMIT_MEMLOCK / CAP_IPC_LOCK).", arena.mlock_failures)

    sessions = registry.sessions
    out.family(
        "swap_state_sessions", "gauge", "Sessions by state.",
        [({"state": state.value}, sum(1 for s in sessions if s.state is state)) for state in SessionState],
    )
    out.family(
        "swap_state_session_segment_bytes", "gauge", "Segment bytes per session.",
        [({"job_id": s.job_id, "rank": s.rank}, s.segment.size if s.segment else 0) for s in sessions],
    )
    out.family(
        "swap_state_session_last_committed_step", "gauge",
        "Last committed step per session (sessions with a committed step only).",
        [({"job_id": s.job_id, "rank": s.rank}, s.last_committed_step)
         for s in sessions if s.last_committed_step is not None],
    )
    out.family(
        "swap_state_session_generation", "gauge", "Current generation per session.",
        [({"job_id": s.job_id, "rank": s.rank}, s.generation) for s in sessions],
    )
    out.one("swap_state_steps_committed_total", "counter", "Steps committed, all sessions.",
            registry.steps_committed_total)
    out.one("swap_state_attaches_total", "counter", "Attach calls that succeeded.", registry.attaches)
    out.one("swap_state_reattaches_total", "counter",
            "Attaches that got a kept session back.", registry.reattaches)
    out.one("swap_state_sessions_freed_total", "counter", "Sessions freed (any reason).",
            registry.sessions_freed)
    out.one("swap_state_sessions_expired_total", "counter",
            "Orphaned sessions freed after the grace period.", registry.sessions_expired)
    out.family(
        "swap_state_rpc_total", "counter", "RPCs by method and status code.",
        [({"method": m, "code": c}, n) for (m, c), n in sorted(counters.calls.items())],
    )
    out.family(
        "swap_state_rpc_seconds_total", "counter", "Seconds spent in RPCs by method.",
        [({"method": m}, s) for m, s in sorted(counters.seconds.items())],
    )
    for add in extra:
        add(out)
    return "\n".join(out.lines) + "\n"


class MetricsServer:
    """``GET /metrics`` on host:port; ``render`` builds the body on each scrape."""

    def __init__(self, render: Callable[[], str], host: str, port: int) -> None:
        self._render = render
        self._host = host
        self._port = port
        self._server: asyncio.base_events.Server | None = None
        self.address: tuple[str, int] | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port,
                                                  reuse_address=True)
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
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", "only GET\n", "text/plain"
            elif path != "/metrics":
                status, body, ctype = "404 Not Found", "try /metrics\n", "text/plain"
            else:
                status, body, ctype = "200 OK", self._render(), CONTENT_TYPE
            data = body.encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
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
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass
