"""Typed configuration of the state server.

:class:`ServerConfig` is what the CLI parses into and what :func:`start_server` takes; it
validates itself (values only) on construction. Checks against the environment (is the shm
directory big enough, is the socket free) happen at start-up, in :mod:`.runtime`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import Literal

from swap_state.proto.segment import PAGE_BYTES

from .errors import ConfigError

__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "TiB",
    "LOG_LEVELS",
    "ListenAddress",
    "ServerConfig",
    "default_listen",
    "default_socket_path",
    "format_size",
    "parse_listen",
    "parse_size",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

LOG_LEVELS = ("debug", "info", "warning", "error")

_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
# Linux sun_path is 108 bytes including the terminating NUL.
_MAX_UNIX_PATH = 107


def parse_size(text: str) -> int:
    """``"64G"`` -> 68719476736. Binary units (K=1024, like ``docker run --shm-size``);
    ``K``/``KiB``/``KB`` are all accepted; a bare number is bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"not a size: {text!r} (expected e.g. 512M, 64G, 1T or a byte count)")
    number, unit = match.groups()
    value = float(number) * _UNITS[unit.upper()]
    if value != value or value > (1 << 62):  # NaN cannot happen with the regex; bound anyway
        raise ConfigError(f"size too large: {text!r}")
    return int(value)


def format_size(nbytes: int) -> str:
    """Human-readable binary size for messages and logs (``1.5GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def default_socket_path() -> pathlib.Path:
    """$XDG_RUNTIME_DIR/swap-state/swap-state.sock, else /run/swap-state/swap-state.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = pathlib.Path(runtime) if runtime else pathlib.Path("/run")
    return base / "swap-state" / "swap-state.sock"


def default_listen() -> str:
    return f"unix://{default_socket_path()}"


@dataclasses.dataclass(frozen=True)
class ListenAddress:
    """A parsed ``--listen`` value."""

    scheme: Literal["unix", "tcp"]
    path: pathlib.Path | None = None
    """The socket file (unix only)."""
    host: str = ""
    """Host or address to bind (tcp only); ``[::1]`` brackets removed."""
    port: int = 0
    """TCP port; 0 picks a free one."""

    @property
    def url(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}"
        return f"tcp://{self._host_port()}"

    def _host_port(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def bind_target(self, port: int | None = None) -> str:
        """The address string grpc's ``add_*_port`` takes."""
        if self.scheme == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port if port is None else port}"


def parse_listen(text: str) -> ListenAddress:
    """``unix:///run/x.sock`` (or a bare absolute path) or ``tcp://host:port``."""
    text = text.strip()
    if text.startswith("unix://") or text.startswith("/"):
        raw = text[len("unix://") :] if text.startswith("unix://") else text
        if not raw.startswith("/"):
            raise ConfigError(f"--listen {text!r}: the unix socket path must be absolute (unix:///path)")
        path = pathlib.Path(os.path.normpath(raw))
        if len(os.fsencode(str(path))) > _MAX_UNIX_PATH:
            raise ConfigError(
                f"--listen {text!r}: a unix socket path may have at most {_MAX_UNIX_PATH} bytes"
            )
        return ListenAddress("unix", path=path)
    if text.startswith("tcp://"):
        rest = text[len("tcp://") :]
        match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([A-Za-z0-9_.-]+):(\d+)", rest)
        if not match:
            raise ConfigError(f"--listen {text!r}: expected tcp://HOST:PORT (IPv6: tcp://[::1]:PORT)")
        host = match.group(1) or match.group(3)
        port = int(match.group(2) or match.group(4))
        if port > 65535:
            raise ConfigError(f"--listen {text!r}: port out of range")
        return ListenAddress("tcp", host=host, port=port)
    raise ConfigError(f"--listen {text!r}: expected unix:///path or tcp://host:port")


def _auto_cow_budget(shm_size: int, chunk_bytes: int) -> int:
    # 1 GiB, but never more than an eighth of a small budget; whole chunks only.
    budget = min(GiB, shm_size // 8)
    return budget // chunk_bytes * chunk_bytes


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs to start. The CLI only parses flags into this."""

    shm_size: int
    """The whole host budget in bytes (``--shm-size``): all segments together, copy-before-write
    slots included, never exceed it."""

    listen: str = dataclasses.field(default_factory=default_listen)
    """``unix:///path`` or ``tcp://host:port`` (``--listen``)."""

    token_file: pathlib.Path | None = None
    """File holding the bearer token clients must present (``--token-file``); None: no auth."""

    snapshot_dir: pathlib.Path | None = None
    """Where snapshots are persisted (``--snapshot-dir``); None: snapshots are refused."""

    grace: float = 30.0
    """Seconds an orphaned session keeps its segment for a reattach (``--grace``)."""

    metrics_port: int = 0
    """Prometheus text endpoint port (``--metrics-port``); 0: off."""

    metrics_host: str = "0.0.0.0"
    """Interface for the metrics endpoint (``--metrics-port HOST:PORT``)."""

    log_level: str = "info"
    """debug | info | warning | error (``--log-level``)."""

    shm_dir: pathlib.Path = pathlib.Path("/dev/shm")
    """Memory filesystem holding the segment files (``--shm-dir``)."""

    shm_group: str | None = None
    """Group (name or gid) given to segment files and the socket; segments become 0660 instead
    of 0600 (``--shm-group``)."""

    chunk_bytes: int = 64 * MiB
    """Snapshot granularity and copy-before-write slot size; a multiple of the page size
    (``--chunk-bytes``)."""

    cow_budget: int | None = None
    """Host-wide copy-before-write pool in bytes, split into per-session slots of
    ``chunk_bytes`` and held back from ``shm_size`` (``--cow-budget``). None: min(1 GiB,
    shm_size / 8), rounded down to whole chunks."""

    persist_max_bandwidth: int = 0
    """Upper bound for snapshot writes in bytes/s (``--persist-max-bandwidth``); 0: unlimited."""

    keep_latest: int = 2
    """Durable snapshots kept per job (``--keep-latest``); at least 2, so the previous one
    survives until the next is durable."""

    tls_cert: pathlib.Path | None = None
    """PEM certificate chain for ``tcp://`` (``--tls-cert``)."""

    tls_key: pathlib.Path | None = None
    """PEM private key for ``tcp://`` (``--tls-key``)."""

    insecure: bool = False
    """Allow ``tcp://`` without TLS (``--insecure``)."""

    mlock: bool = True
    """Try to mlock segments (best effort; a refusal is logged once, never fatal)."""

    keepalive_interval: float = 2.0
    """Seconds between KeepAlive events the server sends on each liveness stream."""

    stream_wait: float = 10.0
    """Seconds after Attach within which the trainer must open its KeepAlive stream; after
    that the session counts as orphaned (and is freed ``grace`` seconds later)."""

    shutdown_grace: float = 10.0
    """On SIGTERM/SIGINT: seconds in-flight RPCs get to finish before they are cancelled."""

    max_tensors: int = 1 << 20
    """Most tensors one Allocate may name."""

    max_message_bytes: int = 64 * MiB
    """gRPC receive limit per message (a 1M-tensor Allocate fits); replies may be twice this."""

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise ConfigError(message)

        if not isinstance(self.shm_size, int) or self.shm_size <= 0:
            fail("--shm-size must be a positive size, e.g. --shm-size 64G")
        listen = parse_listen(self.listen)  # raises ConfigError
        if listen.scheme == "tcp":
            if (self.tls_cert is None) != (self.tls_key is None):
                fail("--tls-cert and --tls-key go together")
            if self.tls_cert is None and not self.insecure:
                fail(
                    f"--listen {self.listen}: TCP needs --tls-cert/--tls-key, or --insecure to "
                    "accept plaintext (bulk data never crosses gRPC, but tokens and control do)"
                )
        elif self.tls_cert is not None or self.tls_key is not None:
            fail("--tls-cert/--tls-key only apply to --listen tcp://...")
        if not self.grace >= 0:
            fail("--grace must be >= 0 seconds")
        if not 0 <= self.metrics_port <= 65535:
            fail("--metrics-port must be 0 (off) or a port number")
        if self.log_level not in LOG_LEVELS:
            fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % PAGE_BYTES:
            fail(f"--chunk-bytes must be a positive multiple of the page size ({PAGE_BYTES})")
        if self.cow_budget is None:
            object.__setattr__(self, "cow_budget", _auto_cow_budget(self.shm_size, self.chunk_bytes))
        elif self.cow_budget < 0:
            fail("--cow-budget must be >= 0")
        if self.cow_budget > self.shm_size:
            fail(
                f"--cow-budget {format_size(self.cow_budget)} exceeds --shm-size "
                f"{format_size(self.shm_size)} (the pool is part of the budget)"
            )
        if self.persist_max_bandwidth < 0:
            fail("--persist-max-bandwidth must be >= 0 (0: unlimited)")
        if self.keep_latest < 2:
            fail("--keep-latest must be >= 2 (the previous snapshot must survive the next)")
        if not self.shm_dir.is_absolute():
            fail("--shm-dir must be an absolute path")
        for name in ("keepalive_interval", "stream_wait", "shutdown_grace"):
            if not getattr(self, name) >= 0:
                fail(f"{name} must be >= 0")
        if self.keepalive_interval <= 0:
            fail("keepalive_interval must be > 0")
        if self.max_tensors < 1 or self.max_message_bytes < 4 * KiB:
            fail("max_tensors must be >= 1 and max_message_bytes >= 4 KiB")

    @property
    def listen_address(self) -> ListenAddress:
        return parse_listen(self.listen)

    @property
    def cow_pool_bytes(self) -> int:
        """The resolved copy-before-write pool (``cow_budget`` after auto sizing)."""
        assert self.cow_budget is not None
        return self.cow_budget

    @property
    def cow_pool_slots(self) -> int:
        """Copy-before-write slots in the host-wide pool (whole chunks)."""
        return self.cow_pool_bytes // self.chunk_bytes
