"""Typed configuration of the state server, the one declaration of its flags, and the command
line made from it, both ways.

:class:`ServerConfig` is what :func:`swap_state.server.start_server` takes; it validates values
on construction (checks against the environment happen at start-up). A field with a
:class:`Flag` is a flag, its docstring the help: :func:`add_server_flags` declares one argparse
option per such field, :func:`config_from_args` turns the parsed namespace into a config, and
:func:`config_to_argv` is the reverse, for the trainer's embedded server, so that
``parse(config_to_argv(c)) == c``. No grpc, no server imports.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import ipaddress
import pathlib
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from .addresses import ListenAddress, default_listen, parse_address
from .errors import ConfigError
from .segment import PAGE_BYTES
from .sizes import GiB, KiB, MiB, TiB, format_size, parse_size

__all__ = [
    "DIRECT_IO_MODES", "EXIT_WITH_PARENT_ENV", "FLAG", "LOG_LEVELS", "Flag", "ServerConfig", "UserFlag",
    "add_server_flags", "attach_negative_values", "config_from_args", "config_to_argv", "field_docs",
    "format_size_flag", "parse_server_argv", "user_flags"
]

LOG_LEVELS = ("debug", "info", "warning", "error")

DIRECT_IO_MODES = ("writes", "off")
"""The values of ``--direct-io``."""

EXIT_WITH_PARENT_ENV = "SWAP_STATE_EXIT_WITH_PARENT"
"""Environment variable an embedded server is started with: the trainer's pid. The server then
stops when the trainer dies (``prctl``, set by the server itself: unsafe between fork and exec
in a process with threads)."""

FLAG = "swap_state.flag"
"""``dataclasses.field`` metadata key of a field that is a command-line flag: its :class:`Flag`."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a :class:`ServerConfig` field appears on the command line: ``--`` + the field name
    with ``-`` for ``_``; help is the field's docstring, its default, then :attr:`example`."""

    example: str
    """``--help``'s example: a value, or a command fragment when it starts with ``--``; ``" or "``
    joins several."""
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


def _flag(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
          **spec: Any) -> Any:
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={FLAG: Flag(**spec)})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs to start. Each field's docstring is its ``--help`` text
    (fields without a :class:`Flag` are set in code only): written for the person starting it."""

    shm_size: int = _flag(kind="size", example="64G")
    """Whole host budget for all segments, the copy-before-write pool included (bytes; K/M/G/T
    suffixes, binary). Checked against the shm directory at start; the server exits with an
    error if it does not fit and never falls back to disk."""

    listen: str = _flag(
        default_factory=default_listen, metavar="ADDRESS", example="unix:///run/swap-state/s.sock",
        default_text="unix://$XDG_RUNTIME_DIR/swap-state/swap-state.sock if XDG_RUNTIME_DIR is "
        "set, else unix:///run/swap-state/swap-state.sock",
    )
    """Where to serve: unix:///path (socket file mode 0660) or tcp://host:port (needs
    --tls-cert/--tls-key or --insecure)."""

    token_file: pathlib.Path | None = _flag(None, example="/etc/swap-state/token")
    """File holding a bearer token; clients must send 'authorization: Bearer <token>' or get
    UNAUTHENTICATED (the health service is exempt). Without it, no authentication."""

    tenants: pathlib.Path | None = _flag(None, metavar="FILE", example="/etc/swap-state/tenants")
    """File of tenants, one per line: 'TENANT TOKEN' or 'TENANT TOKEN admin' (mode 0600). A
    job, its sessions and snapshots belong to the tenant whose token created them; another
    tenant's calls on them fail PERMISSION_DENIED, Stats and ListSnapshots show only the
    caller's, an admin tenant reaches all. Instead of --token-file (one tenant). Without
    either, on a unix socket, each caller's uid is its tenant (root and this server's user
    are admins)."""

    snapshot_dir: pathlib.Path | None = _flag(None, metavar="DIR", example="/ckpt/swap-state")
    """Directory for durable snapshots (safetensors + manifest per job and step); created if
    missing. Without it, snapshots are refused."""

    snapshot_store: str | None = _flag(None, metavar="URI", example="s3://ckpt-bucket/swap-state")
    """A second snapshot tier every host reaches: s3://BUCKET/PREFIX on any S3-compatible
    store (endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... and the AWS
    config), or a path (file:///PATH) on a filesystem all hosts mount. Each durable snapshot is
    uploaded in the background; a rank this server does not hold (a lost host's, one of
    another world size) is restored from it. Needs --snapshot-dir."""

    snapshot_store_timeout: float = _flag(60.0, kind="seconds", example="120")
    """Seconds one request to --snapshot-store may take, retries included, before the upload
    or restore fails naming the store."""

    snapshot_store_max_bandwidth: int = _flag(0, kind="size", metavar="BYTES_PER_S", example="500M")
    """Upper bound for uploads to --snapshot-store in bytes/s (size suffixes allowed), so that
    they leave the network to the training job's collectives; 0 means unlimited."""

    grace: float = _flag(30.0, kind="seconds", example="120")
    """Seconds a session whose trainer vanished (KeepAlive stream closed) keeps its segment for
    the same job/rank to reattach."""

    metrics_port: int = _flag(0, kind="host_port", host_field="metrics_host", metavar="[HOST:]PORT",
                              example="9464 or 127.0.0.1:9464")
    """Serve Prometheus metrics (text format) at http://HOST:PORT/metrics; 0 turns them off.
    HOST defaults to 127.0.0.1 (this host only); 0.0.0.0:PORT lets a scraper on another host in
    (the metrics name jobs, sizes and steps)."""

    metrics_host: str = "127.0.0.1"
    """Interface for the metrics endpoint: the HOST of ``--metrics-port HOST:PORT``."""

    log_level: str = _flag("info", choices=LOG_LEVELS, example="debug")
    """Structured (key=value) log verbosity on stderr."""

    shm_dir: pathlib.Path = _flag(pathlib.Path("/dev/shm"), metavar="DIR", example="/dev/shm")
    """Memory filesystem (tmpfs) for the segment files; the trainers must see the same
    directory."""

    shm_group: str | None = _flag(None, metavar="GROUP", example="trainers")
    """Group (name or gid) given to segment files and the socket; segments become 0660 instead of
    0600 so trainers running as another user in that group can map them."""

    socket_group: str | None = _flag(None, metavar="GROUP", example="trainers")
    """Group (name or gid) given to the socket instead of --shm-group: the users who may call
    this server. For a server run as root, which gives each caller's segment files to that
    caller (0600): --socket-group alone lets a group of users train, each on their own state."""

    discard_segments: bool = _flag(False, example="--discard-segments")
    """At start, remove the segment files a previous server on this --listen left in
    --shm-dir instead of adopting them: every trainer that was using them loses its state
    (it must restore a snapshot). Without it, a server restarted after a crash or an upgrade
    adopts them and its trainers lose nothing."""

    free_segments_on_stop: bool = _flag(False, example="--free-segments-on-stop")
    """On SIGTERM/SIGINT free every segment. Without it, the segments of live sessions stay
    in --shm-dir for the next server on this --listen to adopt (a rolling upgrade costs the
    trainers nothing); the other sessions' are freed."""

    chunk_bytes: int = _flag(64 * MiB, kind="size", example="32M")
    """Snapshot granularity and copy-before-write slot size; a multiple of the page size."""

    cow_budget: int | None = _flag(None, kind="size", example="2G",
                                   default_text="min(1G, shm-size/8), in whole chunks")
    """Host-wide copy-before-write pool in bytes that lets snapshots run while trainers keep
    stepping; split into per-session slots of --chunk-bytes and held back from --shm-size."""

    direct_io: str = _flag("writes", choices=DIRECT_IO_MODES, example="off")
    """Whether snapshot writes to --snapshot-dir bypass the page cache with O_DIRECT. writes:
    snapshots persist through aligned bounce buffers, several writes in flight (measured on a
    virtio disk: 1.35-1.39 GB/s, 1.7-2.2x buffered write + fsync); where the filesystem refuses
    O_DIRECT they are buffered, logged. off: buffered, for a filesystem that accepts O_DIRECT
    but serves it slowly (network filesystems may turn each O_DIRECT write into a synchronous
    round trip). Restores always read through the page cache, mapped and pinned."""

    persist_max_bandwidth: int = _flag(0, kind="size", metavar="BYTES_PER_S", example="2G")
    """Upper bound for snapshot writes to --snapshot-dir in bytes/s (size suffixes allowed);
    0 means unlimited."""

    stage_threads: int = _flag(1, metavar="N", example="2")
    """Threads per persisting snapshot that copy chunks into spare slots ahead of the trainer,
    so it rarely copies or waits itself (a segment with fewer than 3 copy-before-write slots
    has none to spare: its trainer copies what the writer has not read)."""

    model_copy_timeout: float = _flag(60.0, kind="seconds", example="120")
    """Whole-state snapshots: seconds the writer waits for the trainer to finish copying the
    model's parameters of the snapshot's step into its segment (it does so right after the
    step, overlapped with the next forward/backward) before the snapshot fails."""

    keep_latest: int = _flag(2, metavar="K", example="3")
    """Durable snapshots kept per job, at least 2: older ones are removed only after a newer one
    is durable. A job may ask to keep more (torchtitan's keep_latest_k), except a tenant that is
    not an admin: it keeps at most K."""

    tenant_shm_quota: int = _flag(0, kind="size", example="16G")
    """Bytes of segments one tenant (--tenants; without it, all callers together) may hold
    on this server; an Allocate beyond it fails RESOURCE_EXHAUSTED naming this flag, and other
    tenants are unaffected. 0: no quota (--shm-size bounds all)."""

    tenant_snapshot_quota: int = _flag(0, kind="size", example="500G")
    """Bytes of snapshots one tenant may keep in --snapshot-dir: a snapshot that would take it
    beyond is refused (RESOURCE_EXHAUSTED naming this flag) before a byte is written. Retention
    removes old snapshots only after a new one is durable: allow (keep + 1) snapshots of a job.
    0: no quota."""

    tls_cert: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/server.pem")
    """TLS certificate chain for --listen tcp://..."""

    tls_key: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/server.key")
    """TLS private key for --listen tcp://..."""

    tls_client_ca: pathlib.Path | None = _flag(None, metavar="PEM", example="/etc/swap-state/clients-ca.pem")
    """Require a TLS client certificate signed by these roots (mutual TLS): only trainers holding
    one connect. Needs --tls-cert/--tls-key."""

    insecure: bool = _flag(False, example="--listen tcp://127.0.0.1:7070 --insecure")
    """Allow --listen tcp://... without TLS (tokens and control messages in plaintext; bulk data
    never crosses gRPC)."""

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
            got = format_size(self.shm_size) if isinstance(self.shm_size, int) else repr(self.shm_size)
            fail(f"--shm-size must be positive, e.g. --shm-size 64G (got {got})")
        listen = parse_address(self.listen)  # raises ConfigError
        if listen.scheme == "tcp":
            if (self.tls_cert is None) != (self.tls_key is None):
                fail("--tls-cert and --tls-key go together")
            if self.tls_cert is None and not self.insecure:
                fail(f"--listen {self.listen}: TCP needs --tls-cert/--tls-key, or --insecure to accept "
                     "plaintext (bulk data never crosses gRPC, but tokens and control do)")
            if self.token_file is None and self.tenants is None and self.tls_client_ca is None and not _loopback(listen.host):
                fail(f"--listen {self.listen} reaches beyond this host, and without --token-file anyone who "
                     "reaches it could attach to, read and roll back every job's state: give --token-file "
                     "FILE (its token, sent by every trainer) or --tls-client-ca (client certificates), or "
                     "listen on tcp://127.0.0.1:PORT or a unix socket")
        if self.token_file is not None and self.tenants is not None:
            fail("--token-file and --tenants exclude each other: list that token as a tenant in --tenants")
        if self.tls_client_ca is not None and self.tls_cert is None:
            fail("--tls-client-ca needs --tls-cert/--tls-key (mutual TLS on --listen tcp://...)")
        if listen.scheme != "tcp" and (self.tls_cert is not None or self.tls_key is not None):
            fail("--tls-cert/--tls-key only apply to --listen tcp://...")
        for flag, value, choices in (("--direct-io", self.direct_io, DIRECT_IO_MODES),
                                     ("--log-level", self.log_level, LOG_LEVELS)):
            if value not in choices:
                fail(f"{flag} must be one of {', '.join(choices)}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % PAGE_BYTES:
            fail(f"--chunk-bytes must be a positive multiple of the page size ({PAGE_BYTES})")
        if self.cow_budget is None:  # 1 GiB, at most an eighth of a small budget; whole chunks
            budget = min(GiB, self.shm_size // 8)
            object.__setattr__(self, "cow_budget", budget // self.chunk_bytes * self.chunk_bytes)
        elif self.cow_budget < 0:
            fail("--cow-budget must be >= 0")
        if self.cow_budget > self.shm_size:
            fail(
                f"--cow-budget {format_size(self.cow_budget)} exceeds --shm-size "
                f"{format_size(self.shm_size)} (the pool is part of the budget)"
            )
        if self.snapshot_store and self.snapshot_dir is None:
            fail("--snapshot-store needs --snapshot-dir: snapshots become durable there first, "
                 "then are uploaded")
        for ok, message in (  # each rule as it must hold (a NaN breaks it)
            (self.grace >= 0, "--grace must be >= 0 seconds"),
            (0 <= self.metrics_port <= 65535, "--metrics-port must be 0 (off) or a port number"),
            (self.persist_max_bandwidth >= 0, "--persist-max-bandwidth must be >= 0 (0: unlimited)"),
            (self.tenant_shm_quota >= 0, "--tenant-shm-quota must be >= 0 (0: no quota)"),
            (self.tenant_snapshot_quota >= 0, "--tenant-snapshot-quota must be >= 0 (0: no quota)"),
            (1 <= self.stage_threads <= 64, "--stage-threads must be between 1 and 64"),
            (self.model_copy_timeout > 0, "--model-copy-timeout must be > 0 seconds"),
            (self.keep_latest >= 2, "--keep-latest must be >= 2 (the last snapshot must survive the next)"),
            (self.snapshot_store_max_bandwidth >= 0,
             "--snapshot-store-max-bandwidth must be >= 0 (0: unlimited)"),
            (self.snapshot_store_timeout > 0, "--snapshot-store-timeout must be > 0 seconds"),
            (self.shm_dir.is_absolute(), "--shm-dir must be an absolute path"),
            (self.stream_wait >= 0, "stream_wait must be >= 0"),
            (self.shutdown_grace >= 0, "shutdown_grace must be >= 0"),
            (self.keepalive_interval > 0, "keepalive_interval must be > 0"),
            (self.max_tensors >= 1 and self.max_message_bytes >= 4 * KiB,
             "max_tensors must be >= 1 and max_message_bytes >= 4 KiB"),
        ):
            if not ok:
                fail(message)

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


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass's attribute docstrings, whitespace collapsed; empty
    where the source is unavailable."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped: help still has examples
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class UserFlag:
    """One command-line flag: the field it sets and its declaration."""

    field: dataclasses.Field
    spec: Flag

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> str:
        if self.spec.kind is not None:
            return self.spec.kind
        # the annotation's text (``from __future__ import annotations`` above)
        return {"bool": "switch", "int": "int", "float": "float", "str": "str",
                "pathlib.Path": "path"}[str(self.field.type).removesuffix(" | None")]

    @property
    def required(self) -> bool:
        return (self.field.default is dataclasses.MISSING
                and self.field.default_factory is dataclasses.MISSING)

    @property
    def metavar(self) -> str | None:
        if self.spec.metavar is not None or self.spec.choices is not None:
            return self.spec.metavar
        return {"size": "SIZE", "seconds": "SECONDS", "int": "N", "float": "X", "path": "PATH",
                "str": self.name.upper(), "switch": None}.get(self.kind)

    def default_text(self) -> str | None:
        """The default as ``--help`` shows it, None when there is nothing to show."""
        if self.spec.default_text is not None:
            return self.spec.default_text
        if self.required:
            return None
        factory = self.field.default_factory
        value = self.field.default if factory is dataclasses.MISSING else factory()
        if value is None or self.kind == "switch":
            return None
        return self.format(value)

    def parse(self, text: str) -> Any:
        return _PARSERS[self.kind](text)

    def format(self, value: Any) -> str:
        if self.kind == "size":
            return format_size_flag(value)
        if self.kind in ("seconds", "float"):
            return repr(float(value)).removesuffix(".0")
        return str(value)

    def help(self) -> str:
        parts = [field_docs(ServerConfig).get(self.name, "").replace("``", "")]
        if self.required:
            parts.append("Required.")
        default = self.default_text()
        if default is not None:
            parts.append(f"Default: {default}.")
        examples = [e if e.startswith("--") else f"{self.option} {e}"
                    for e in self.spec.example.split(" or ")]
        parts.append("e.g. " + " or ".join(examples))
        return " ".join(p for p in parts if p).replace("%", "%%")  # argparse %-formats help


@functools.cache
def user_flags() -> tuple[UserFlag, ...]:
    """The flags, in field order: every :class:`ServerConfig` field with a ``Flag``."""
    return tuple(UserFlag(field, field.metadata[FLAG])
                 for field in dataclasses.fields(ServerConfig) if FLAG in field.metadata)


def format_size_flag(nbytes: int) -> str:
    """Bytes as the shortest exact size flag value: ``67108864`` -> ``"64M"``."""
    for suffix, unit in (("T", TiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def _size(text: str) -> int:
    """A size; a negative one (``-5G``) parses too, for the config to refuse with the flag's rule."""
    stripped = text.strip()
    sign = -1 if stripped.startswith("-") else 1
    try:
        return sign * parse_size(stripped.removeprefix("-").removesuffix("/s"))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(
            str(exc) if sign > 0 else f"not a size: {text!r} (expected e.g. 512M, 64G or 1T)"
        ) from None


def _seconds(text: str) -> float:
    """A number; the config refuses one out of the flag's range, naming the flag."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def _host_port(text: str) -> tuple[str | None, int]:
    host, sep, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PORT or HOST:PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {text!r}")
    return (host.strip("[]") if sep else None), number


_PARSERS: dict[str, Callable[[str], Any]] = {
    "size": _size, "seconds": _seconds, "host_port": _host_port, "int": int, "float": float, "str": str,
    "path": pathlib.Path, "switch": bool,
}


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Declare every user flag on ``parser``; one not given leaves no attribute (the config's
    default holds)."""
    for flag in user_flags():
        options: dict[str, Any] = {"dest": flag.name, "default": argparse.SUPPRESS,
                                   "help": flag.help()}
        if flag.kind == "switch":
            if flag.field.default is not False:
                raise TypeError(f"{flag.name}: a switch flag must default to False")
            options["action"] = "store_true"
        else:
            options.update(type=flag.parse, metavar=flag.metavar, required=flag.required)
            if flag.spec.choices is not None:
                options["choices"] = flag.spec.choices
        parser.add_argument(flag.option, **options)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The namespace of a parser built with :func:`add_server_flags` -> config (or ConfigError)."""
    return config_from_settings({flag.name: getattr(args, flag.name) for flag in user_flags() if hasattr(args, flag.name)})


def setting_value(name: str, value: Any) -> Any:
    """``value`` of setting ``name``: a flag's text parsed as the flag parses it, else as is."""
    flag = next((flag for flag in user_flags() if flag.name == name), None)
    return flag.parse(value) if flag is not None and isinstance(value, str) else value


def config_from_settings(settings: Mapping[str, Any]) -> ServerConfig:
    """Settings by field name -> config (or ConfigError); a flag's value may be its text
    (``"64G"``, parsed as the flag parses it) or the value itself."""
    flags = {flag.name: flag for flag in user_flags()}
    values: dict[str, Any] = {}
    for name, value in settings.items():
        flag = flags.get(name)
        value = setting_value(name, value)
        if flag is not None and flag.kind == "host_port" and isinstance(value, tuple):
            host, value = value
            if host and flag.spec.host_field:
                values[flag.spec.host_field] = host
        values[name] = value
    return ServerConfig(**values)


def parse_server_argv(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> ServerConfig:
    """Flags (None: ``sys.argv[1:]``) -> config, exiting 2 with usage on bad flags. ``parser``:
    one built with :func:`add_server_flags` (None: a bare one)."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="swap-state-server")
        add_server_flags(parser)
    args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else argv))
    try:
        return config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))  # exits


_NEGATIVE = re.compile(r"-\d")


def attach_negative_values(argv: list[str]) -> list[str]:
    """``--shm-size -5G`` -> ``--shm-size=-5G``: argparse takes ``-5G`` for an option, attached
    it reaches the flag's parser and the config refuses it with the flag's rule."""
    takes_value = {flag.option for flag in user_flags() if flag.kind != "switch"}
    out: list[str] = []
    items = iter(argv)
    for arg in items:
        out.append(arg)
        if arg == "--":
            out.extend(items)
        elif arg in takes_value and (value := next(items, None)) is not None:
            if _NEGATIVE.match(value):
                out[-1] = f"{arg}={value}"
            else:
                out.append(value)
    return out


def _resolves_to(config: ServerConfig, name: str, value: Any) -> bool:
    """Whether leaving ``name`` out (None) gives ``value`` again, resolved on construction."""
    try:
        return getattr(dataclasses.replace(config, **{name: None}), name) == value
    except ConfigError:
        return False


def config_to_argv(config: ServerConfig) -> list[str]:
    """The ``swap-state-server`` flags that reproduce ``config`` (``--shm-size`` and ``--listen``
    always, others where not default) as ``--flag=value``; ValueError for a setting that has
    no flag (``mlock``, ...) away from its default."""
    flags = user_flags()
    named = {f.name for f in flags} | {f.spec.host_field for f in flags if f.spec.host_field}
    for field in dataclasses.fields(ServerConfig):
        if field.name not in named and getattr(config, field.name) != field.default:
            raise ValueError(
                f"ServerConfig.{field.name}={getattr(config, field.name)!r} has no command-line "
                "flag: a server started from argv cannot reproduce it"
            )
    argv: list[str] = []
    for flag in flags:
        value, field = getattr(config, flag.name), flag.field
        if flag.kind == "host_port" and flag.spec.host_field:
            host = getattr(config, flag.spec.host_field)
            default_host = ServerConfig.__dataclass_fields__[flag.spec.host_field].default
            if value != field.default or host != default_host:
                where = "" if host == default_host else f"[{host}]:" if ":" in host else f"{host}:"
                argv.append(f"{flag.option}={where}{value}")
            continue
        # A default_factory (--listen) depends on the environment where the argv runs: say it.
        if field.default_factory is dataclasses.MISSING:
            if not flag.required and value == field.default:
                continue
            if field.default is None and value is not None and _resolves_to(config, flag.name, value):
                continue  # e.g. --cow-budget: the same value comes back from the other flags
            if value is None:
                raise ValueError(f"ServerConfig.{flag.name}=None cannot be written as {flag.option}")
        if flag.kind != "switch":
            argv.append(f"{flag.option}={flag.format(value)}")
        elif value:
            argv.append(flag.option)
    return argv
