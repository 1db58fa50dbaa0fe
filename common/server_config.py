"""Typed configuration of the state server, the one declaration of its flags: the CLI is generated
from :class:`ServerConfig` (a field with a :class:`Flag` is a flag, its docstring the help). It
validates values on construction; checks against the environment happen at start-up.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import pathlib
from typing import Any

from .addresses import default_listen, parse_address, parse_peers
from .errors import ConfigError
from .object_store import STORE_TIMEOUT_S
from .segment import PAGE_BYTES
from .sizes import GiB, KiB, MiB, format_size
from .text_enum import TextEnum

__all__ = ["EXIT_WITH_PARENT_ENV", "FLAG", "DirectIO", "Flag", "LogLevel", "ServerConfig", "SnapshotSettings"]


class LogLevel(TextEnum):
    """``--log-level``."""

    DEBUG, INFO, WARNING, ERROR = "debug", "info", "warning", "error"


class DirectIO(TextEnum):
    """``--direct-io``: whether snapshot writes may bypass the page cache."""

    WRITES, OFF = "writes", "off"


@dataclasses.dataclass(frozen=True)
class SnapshotSettings:
    """What the snapshot coordinator takes: each default declared here once (the server's flags
    default to these; :meth:`ServerConfig.snapshot_settings` builds it from them)."""

    keep_latest: int | None = 2
    """Complete snapshots kept per job (>= 2; None keeps all)."""
    stage_threads: int = 1
    """Copy-ahead threads per persisting rank."""
    model_copy_timeout_s: float = 60.0
    """Seconds the writer waits for the trainer's copy of the model's parameters."""
    direct_io: DirectIO = DirectIO.WRITES
    """Whether snapshot writes may use O_DIRECT."""
    store_uri: str | None = None
    """The store each durable snapshot is uploaded to (None: none)."""
    store_timeout_s: float = STORE_TIMEOUT_S
    """Seconds one request to the store may take, retries included."""
    store_max_bandwidth: float | None = None
    """The cap on uploads in bytes/s (None: none)."""
    tenant_snapshot_quota: int = 0
    """Bytes of snapshots one tenant may keep (0: no quota)."""
    replica_peers: str | None = None
    """The peers each durable snapshot is replicated to (``tcp://HOST:PORT,...``; None: none)."""
    replica_secret_file: pathlib.Path | None = None
    """The secret the peers prove to each other (None: mutual TLS alone)."""
    replica_tls: tuple[pathlib.Path, pathlib.Path, pathlib.Path] | None = None
    """(certificate chain, key, roots) of mutual TLS on the replica wire (None: none)."""
    replica_max_bandwidth: float | None = None
    """The cap on sending replicas in bytes/s (None: none)."""

EXIT_WITH_PARENT_ENV = "SWAP_STATE_EXIT_WITH_PARENT"
"""Environment variable an embedded server is started with: the trainer's pid. The server then stops when the trainer
dies (``prctl``, set by the server itself: unsafe between fork and exec in a process with threads)."""

FLAG = "swap_state.flag"
"""``dataclasses.field`` metadata key of a field that is a command-line flag: its :class:`Flag`."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a :class:`ServerConfig` field appears on the command line: ``--`` + the field name
    with ``-`` for ``_``; help is the field's docstring, its default, then :attr:`example`."""

    example: str
    """``--help``'s example: a value, or a command fragment when it starts with ``--``; ``" or "`` joins several."""
    metavar: str | None = None
    """Placeholder in ``--help``; None: by kind and type (SIZE, SECONDS, PATH, N, ...)."""
    kind: str | None = None
    """``"size"`` (K/M/G/T suffixes, ``/s`` allowed), ``"seconds"`` (>= 0), ``"host_port"``
    (``[HOST:]PORT``); None: by the field's type (bool: a switch)."""
    choices: tuple[str, ...] | None = None
    """The only values accepted."""
    default_text: str | None = None
    """``--help``'s default when the field's own default does not say it."""
    host_field: str | None = None
    """For ``kind="host_port"``: the field the HOST part sets."""


def _loopback(host: str) -> bool:
    """Whether ``host`` names this host only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def _flag(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **spec: Any) -> Any:
    return dataclasses.field(default=default, default_factory=default_factory, metadata={FLAG: Flag(**spec)})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs to start. Each field's docstring is its ``--help`` text
    (fields without a :class:`Flag` are set in code only): written for the person starting it."""

    shm_size: int = _flag(kind="size", example="64G")
    """Whole host budget for all segments, the copy-before-write pool included (bytes; K/M/G/T
    suffixes, binary). Checked against the shm directory at start; the server exits with an
    error if it does not fit and never falls back to disk."""
    listen: str = _flag(default_factory=default_listen, metavar="ADDRESS", example="unix:///run/swap-state/s.sock",
                        default_text="unix://$XDG_RUNTIME_DIR/swap-state/swap-state.sock if XDG_RUNTIME_DIR is "
                        "set, else unix:///run/swap-state/swap-state.sock")
    """Where to serve: unix:///path (socket file mode 0660) or tcp://host:port (needs
    --tls-cert/--tls-key or --insecure)."""
    token_file: pathlib.Path | None = _flag(None, example="/etc/swap-state/token")
    """File holding a bearer token; clients must send 'authorization: Bearer <token>' or get
    UNAUTHENTICATED (the health service is exempt). Without it, no authentication."""
    tenants: pathlib.Path | None = _flag(None, metavar="FILE", example="/etc/swap-state/tenants")
    """File of tenants, one per line: 'TENANT TOKEN' or 'TENANT TOKEN admin' (mode 0600). A job, its sessions and
    snapshots belong to the tenant whose token created them; another tenant's calls on them fail PERMISSION_DENIED,
    Stats and ListSnapshots show only the caller's, an admin tenant reaches all. Instead of --token-file (one tenant).
    Without either, on a unix socket, each caller's uid is its tenant (root and this server's user are admins)."""
    snapshot_dir: pathlib.Path | None = _flag(None, metavar="DIR", example="/ckpt/swap-state")
    """Directory for durable snapshots (safetensors + manifest per job and step); created if
    missing. Without it, snapshots are refused."""
    snapshot_store: str | None = _flag(None, metavar="URI", example="s3://ckpt-bucket/swap-state")
    """A second snapshot tier every host reaches: s3://BUCKET/PREFIX on any S3-compatible store (endpoint and
    credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... and the AWS config), or a path (file:///PATH) on a
    filesystem all hosts mount. Each durable snapshot is uploaded in the background; a rank this server does not hold (a
    lost host's, one of another world size) is restored from it. Needs --snapshot-dir."""
    snapshot_store_timeout: float = _flag(SnapshotSettings.store_timeout_s, kind="seconds", example="120")
    """Seconds one request to --snapshot-store may take, retries included, before the upload
    or restore fails naming the store."""
    snapshot_store_max_bandwidth: int = _flag(0, kind="size", metavar="BYTES_PER_S", example="500M")
    """Upper bound for uploads to --snapshot-store in bytes/s (size suffixes allowed), so that
    they leave the network to the training job's collectives; 0 means unlimited."""
    replica_peers: str | None = _flag(None, metavar="ADDR[,ADDR...]", example="tcp://host-b:7071")
    """Send each snapshot, while the disk persists it, into the memory of a peer server on another host (each ADDR as
    that peer gives it to --replica-listen; the first that takes a snapshot gets it), so a lost host's state is restored
    from the peer's memory instead of the store; memory-only snapshots (a trainer's replica interval) go to this host's
    memory and the peer's alone. A peer that is down or full fails the replica, never the snapshot. Needs
    --snapshot-dir, and --replica-secret-file or mutual TLS (--replica-tls-cert)."""
    replica_listen: str | None = _flag(None, metavar="tcp://HOST:PORT", example="tcp://0.0.0.0:7071")
    """Take replicas from the servers whose --replica-peers name this address, into memory set
    aside with --replica-size (files under --shm-dir, so a restarted server keeps them). Needs
    --replica-size, and --replica-secret-file or mutual TLS (--replica-tls-cert)."""
    replica_size: int = _flag(0, kind="size", example="96G")
    """Memory for the replicas peers send (besides --shm-size, which is the trainers'): the
    oldest replicas are evicted for newer ones, never a job's newest; a replica that does not
    fit is refused (the sender's snapshot stays durable). Removed replicas' files are kept as
    spares within it, for newer ones to be written over (dropped first when room is needed)."""
    replica_secret_file: pathlib.Path | None = _flag(None, metavar="FILE", example="/etc/swap-state/replica-secret")
    """A secret of at least 16 bytes (mode 0600) every replica peer holds: each side proves it
    holds it before a byte is sent (HMAC, never the secret itself). The bytes then travel in
    plaintext: on a network others share, add mutual TLS (--replica-tls-cert)."""
    replica_tls_cert: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/peer.pem")
    """This server's certificate chain on the replica wire: mutual TLS, with --replica-tls-key and
    --replica-tls-ca. Each side of a replica connection presents one, the bytes are encrypted,
    and a peer's must name the host in --replica-peers. With it --replica-secret-file is optional
    (both: both are checked). Encrypting costs the sender's CPU: replication is slower."""
    replica_tls_key: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/peer.key")
    """The private key of --replica-tls-cert."""
    replica_tls_ca: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/peers-ca.pem")
    """The roots every replica peer's certificate must chain to (use a CA of servers only: any
    certificate it signed may send replicas and read them)."""
    replica_max_bandwidth: int = _flag(0, kind="size", metavar="BYTES_PER_S", example="2G")
    """Upper bound for sending replicas to --replica-peers in bytes/s (a snapshot is sent while
    the disk persists it, so this paces its persisting too); 0 means unlimited."""
    grace: float = _flag(30.0, kind="seconds", example="120")
    """Seconds a session whose trainer vanished (KeepAlive stream closed) keeps its segment for
    the same job/rank to reattach."""
    metrics_port: int = _flag(0, kind="host_port", host_field="metrics_host", metavar="[HOST:]PORT",
                              example="9464 or 127.0.0.1:9464")
    """Serve Prometheus metrics (text format) at http://HOST:PORT/metrics; 0 turns them off. HOST defaults to 127.0.0.1
    (this host only); 0.0.0.0:PORT lets a scraper on another host in (the metrics name jobs, sizes and steps)."""
    metrics_host: str = "127.0.0.1"
    """Interface for the metrics endpoint: the HOST of ``--metrics-port HOST:PORT``."""
    log_level: LogLevel = _flag(LogLevel.INFO, kind="str", choices=tuple(LogLevel), example="debug")
    """Structured (key=value) log verbosity on stderr."""
    shm_dir: pathlib.Path = _flag(pathlib.Path("/dev/shm"), metavar="DIR", example="/dev/shm")
    """Memory filesystem (tmpfs) for the segment files; the trainers must see the same directory."""
    shm_group: str | None = _flag(None, metavar="GROUP", example="trainers")
    """Group (name or gid) given to segment files and the socket; segments become 0660 instead of
    0600 so trainers running as another user in that group can map them."""
    socket_group: str | None = _flag(None, metavar="GROUP", example="trainers")
    """Group (name or gid) given to the socket instead of --shm-group: the users who may call
    this server. For a server run as root, which gives each caller's segment files to that
    caller (0600): --socket-group alone lets a group of users train, each on their own state."""
    discard_segments: bool = _flag(False, example="--discard-segments")
    """At start, remove the segment files a previous server on this --listen left in --shm-dir instead of adopting them:
    every trainer that was using them loses its state (it must restore a snapshot). Without it, a server restarted after
    a crash or an upgrade adopts them and its trainers lose nothing."""
    free_segments_on_stop: bool = _flag(False, example="--free-segments-on-stop")
    """On SIGTERM/SIGINT free every segment. Without it, the segments of every session the
    server holds (live ones, and orphaned ones within --grace) stay in --shm-dir for the next
    server on this --listen to adopt (a rolling upgrade costs the trainers nothing)."""
    chunk_bytes: int = _flag(64 * MiB, kind="size", example="32M")
    """Snapshot granularity and copy-before-write slot size; a multiple of the page size."""
    cow_budget: int | None = _flag(None, kind="size", example="2G", default_text="min(1G, shm-size/8), in whole chunks")
    """Host-wide copy-before-write pool in bytes that lets snapshots run while trainers keep
    stepping; split into per-session slots of --chunk-bytes and held back from --shm-size."""
    direct_io: DirectIO = _flag(SnapshotSettings.direct_io, kind="str", choices=tuple(DirectIO), example="off")
    """Whether snapshot writes to --snapshot-dir bypass the page cache with O_DIRECT. writes: yes, buffered (and logged)
    where the filesystem refuses O_DIRECT. off: buffered, for a filesystem that serves O_DIRECT slowly (network
    filesystems may make each write a synchronous round trip). Restores always read through the page cache."""
    persist_max_bandwidth: int = _flag(0, kind="size", metavar="BYTES_PER_S", example="2G")
    """Upper bound for snapshot writes to --snapshot-dir in bytes/s (size suffixes allowed); 0 means unlimited."""
    stage_threads: int = _flag(SnapshotSettings.stage_threads, metavar="N", example="2")
    """Threads per persisting snapshot that copy chunks into spare slots ahead of the trainer,
    so it rarely copies or waits itself (a segment with fewer than 3 copy-before-write slots
    has none to spare: its trainer copies what the writer has not read)."""
    model_copy_timeout: float = _flag(SnapshotSettings.model_copy_timeout_s, kind="seconds", example="120")
    """Whole-state snapshots: seconds the writer waits for the trainer to finish copying the
    model's parameters of the snapshot's step into its segment (it does so right after the
    step, overlapped with the next forward/backward) before the snapshot fails."""
    keep_latest: int = _flag(SnapshotSettings.keep_latest, metavar="K", example="3")
    """Durable snapshots kept per job, at least 2: older ones are removed only after a newer one is durable. A job may
    ask to keep more (torchtitan's keep_latest_k), except a tenant that is not an admin: it keeps at most K."""
    tenant_shm_quota: int = _flag(0, kind="size", example="16G")
    """Bytes of segments one tenant (--tenants; without it, all callers together) may hold
    on this server; an Allocate beyond it fails RESOURCE_EXHAUSTED naming this flag, and other
    tenants are unaffected. 0: no quota (--shm-size bounds all)."""
    tenant_snapshot_quota: int = _flag(SnapshotSettings.tenant_snapshot_quota, kind="size", example="500G")
    """Bytes of snapshots one tenant may keep in --snapshot-dir: a snapshot that would take it beyond is refused
    (RESOURCE_EXHAUSTED naming this flag) before a byte is written. Retention removes old snapshots only after a new one
    is durable: allow (keep + 1) snapshots of a job. 0: no quota."""
    tls_cert: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/server.pem")
    """TLS certificate chain for --listen tcp://..."""
    tls_key: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/server.key")
    """TLS private key for --listen tcp://..."""
    tls_client_ca: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/clients-ca.pem")
    """Require a TLS client certificate signed by these roots (mutual TLS): only trainers holding
    one connect. Needs --tls-cert/--tls-key."""
    insecure: bool = _flag(False, example="--listen tcp://127.0.0.1:7070 --insecure")
    """Allow --listen tcp://... without TLS (tokens and control messages in plaintext; bulk data never crosses gRPC)."""
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
        if not isinstance(self.shm_size, int) or self.shm_size <= 0:
            got = format_size(self.shm_size) if isinstance(self.shm_size, int) else repr(self.shm_size)
            raise ConfigError(f"--shm-size must be positive, e.g. --shm-size 64G (got {got})")
        listen = parse_address(self.listen)  # raises ConfigError
        if self.replica_peers is not None:
            parse_peers(self.replica_peers)
        if self.replica_listen is not None and parse_address(self.replica_listen, "--replica-listen").scheme != "tcp":
            raise ConfigError(f"--replica-listen {self.replica_listen}: expected tcp://HOST:PORT")
        if listen.scheme == "tcp":
            if (self.tls_cert is None) != (self.tls_key is None):
                raise ConfigError("--tls-cert and --tls-key go together")
            if self.tls_cert is None and not self.insecure:
                raise ConfigError(f"--listen {self.listen}: TCP needs --tls-cert/--tls-key, or --insecure to "
                                  "accept plaintext (bulk data never crosses gRPC, but tokens and control do)")
            if (self.token_file is None and self.tenants is None and self.tls_client_ca is None
                    and not _loopback(listen.host)):
                raise ConfigError(f"--listen {self.listen} reaches beyond this host, and without --token-file "
                                  "anyone who reaches it could attach to, read and roll back every job's state: "
                                  "give --token-file FILE (its token, sent by every trainer) or --tls-client-ca "
                                  "(client certificates), or listen on tcp://127.0.0.1:PORT or a unix socket")
        if self.token_file is not None and self.tenants is not None:
            raise ConfigError("--token-file and --tenants exclude each other: list that token as a tenant in --tenants")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca needs --tls-cert/--tls-key (mutual TLS on --listen tcp://...)")
        if listen.scheme != "tcp" and (self.tls_cert is not None or self.tls_key is not None):
            raise ConfigError("--tls-cert/--tls-key only apply to --listen tcp://...")
        for name, mode in (("direct_io", DirectIO), ("log_level", LogLevel)):
            try:
                object.__setattr__(self, name, mode(getattr(self, name)))
            except ValueError:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(mode)}") from None
        if self.chunk_bytes <= 0 or self.chunk_bytes % PAGE_BYTES:
            raise ConfigError(f"--chunk-bytes must be a positive multiple of the page size ({PAGE_BYTES})")
        if self.cow_budget is None:  # 1 GiB, at most an eighth of a small budget; whole chunks
            object.__setattr__(self, "cow_budget", min(GiB, self.shm_size // 8) // self.chunk_bytes * self.chunk_bytes)
        for ok, message in (  # each rule as it must hold (a NaN breaks it)
            (self.cow_budget >= 0, "--cow-budget must be >= 0"),
            (self.cow_budget <= self.shm_size, f"--cow-budget {format_size(self.cow_budget)} exceeds --shm-size "
                                               f"{format_size(self.shm_size)} (the pool is part of the budget)"),
            (not self.snapshot_store or self.snapshot_dir is not None,
             "--snapshot-store needs --snapshot-dir: snapshots become durable there first, then are uploaded"),
            (not self.replica_peers or self.snapshot_dir is not None,
             "--replica-peers needs --snapshot-dir: snapshots become durable there first, then are replicated"),
            ((self.replica_tls_cert is None) == (self.replica_tls_key is None) == (self.replica_tls_ca is None),
             "--replica-tls-cert, --replica-tls-key and --replica-tls-ca go together (mutual TLS)"),
            (self.replica_tls_cert is None or self.replica_peers or self.replica_listen,
             "--replica-tls-* apply to the replica wire: give --replica-peers or --replica-listen too"),
            (not (self.replica_peers or self.replica_listen) or self.replica_secret_file is not None
             or self.replica_tls_cert is not None,
             "--replica-peers and --replica-listen need --replica-secret-file (the secret every peer holds) "
             "or mutual TLS (--replica-tls-cert, --replica-tls-key, --replica-tls-ca)"),
            (not self.replica_listen or self.replica_size > 0,
             "--replica-listen needs --replica-size: the memory the replicas may take, e.g. --replica-size 96G"),
            (self.replica_size >= 0 and self.replica_max_bandwidth >= 0,
             "--replica-size and --replica-max-bandwidth must be >= 0"),
            (self.grace >= 0, "--grace must be >= 0 seconds"),
            (0 <= self.metrics_port <= 65535, "--metrics-port must be 0 (off) or a port number"),
            (self.persist_max_bandwidth >= 0, "--persist-max-bandwidth must be >= 0 (0: unlimited)"),
            (self.tenant_shm_quota >= 0, "--tenant-shm-quota must be >= 0 (0: no quota)"),
            (self.tenant_snapshot_quota >= 0, "--tenant-snapshot-quota must be >= 0 (0: no quota)"),
            (1 <= self.stage_threads <= 64, "--stage-threads must be between 1 and 64"),
            (self.model_copy_timeout > 0, "--model-copy-timeout must be > 0 seconds"),
            (self.keep_latest >= 2, "--keep-latest must be >= 2 (the last snapshot must survive the next)"),
            (self.snapshot_store_max_bandwidth >= 0, "--snapshot-store-max-bandwidth must be >= 0 (0: unlimited)"),
            (self.snapshot_store_timeout > 0, "--snapshot-store-timeout must be > 0 seconds"),
            (self.shm_dir.is_absolute(), "--shm-dir must be an absolute path"),
            (self.stream_wait >= 0, "stream_wait must be >= 0"),
            (self.shutdown_grace >= 0, "shutdown_grace must be >= 0"),
            (self.keepalive_interval > 0, "keepalive_interval must be > 0"),
            (self.max_tensors >= 1 and self.max_message_bytes >= 4 * KiB,
             "max_tensors must be >= 1 and max_message_bytes >= 4 KiB")):
            if not ok:
                raise ConfigError(message)

    @property
    def snapshot_settings(self) -> SnapshotSettings:
        """The snapshot coordinator's settings from these flags."""
        return SnapshotSettings(
            keep_latest=self.keep_latest, stage_threads=self.stage_threads,
            model_copy_timeout_s=self.model_copy_timeout, direct_io=self.direct_io, store_uri=self.snapshot_store,
            store_timeout_s=self.snapshot_store_timeout, tenant_snapshot_quota=self.tenant_snapshot_quota,
            store_max_bandwidth=self.snapshot_store_max_bandwidth or None, replica_peers=self.replica_peers,
            replica_secret_file=self.replica_secret_file, replica_max_bandwidth=self.replica_max_bandwidth or None,
            replica_tls=None if self.replica_tls_cert is None else (
                self.replica_tls_cert, self.replica_tls_key, self.replica_tls_ca))  # type: ignore[arg-type]

    @property
    def cow_pool_bytes(self) -> int:
        """The resolved copy-before-write pool (``cow_budget`` after auto sizing)."""
        assert self.cow_budget is not None
        return self.cow_budget

    @property
    def cow_pool_slots(self) -> int:
        """Copy-before-write slots in the host-wide pool (whole chunks)."""
        return self.cow_pool_bytes // self.chunk_bytes
