"""Typed configuration of the state server: the one declaration of its flags.

:class:`ServerConfig` is what the CLI is generated from and parses into, what
:func:`swap_state.server.start_server` takes, and what the trainer's embedded server builds its
argv from (so it lives in ``common``, importable without the server); it
validates itself (values only) on construction. Checks against the environment (is the shm
directory big enough, is the socket free) happen at start-up, in :mod:`.runtime`.
"""

from __future__ import annotations

import dataclasses
import pathlib

from .addresses import ListenAddress, default_listen, parse_address
from .errors import ConfigError
from .segment import PAGE_BYTES
from .sizes import GiB, KiB, MiB, format_size

__all__ = ["LOG_LEVELS", "ServerConfig"]

LOG_LEVELS = ("debug", "info", "warning", "error")


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
        listen = parse_address(self.listen)  # raises ConfigError
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
        return parse_address(self.listen)

    @property
    def cow_pool_bytes(self) -> int:
        """The resolved copy-before-write pool (``cow_budget`` after auto sizing)."""
        assert self.cow_budget is not None
        return self.cow_budget

    @property
    def cow_pool_slots(self) -> int:
        """Copy-before-write slots in the host-wide pool (whole chunks)."""
        return self.cow_pool_bytes // self.chunk_bytes
