"""``swap-state-server``: parse flags into :class:`ServerConfig`, run until SIGTERM/SIGINT.

Exit codes: 0 after a clean stop (signal), 1 when the environment does not allow starting
(shm too small, socket taken, unreadable token file, ...), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal
import sys
import textwrap

from swap_state.common.addresses import default_listen
from swap_state.common.server_config import LOG_LEVELS, ServerConfig
from swap_state.common.sizes import parse_size
from swap_state.common.errors import ConfigError, StartupError
from .logs import configure_logging, log_event
from .runtime import start_server

__all__ = ["build_parser", "config_from_args", "main", "parse_config"]

log = logging.getLogger("swap_state.server")

_EPILOG = textwrap.dedent(
    """\
    examples:
      swap-state-server --shm-size 64G
      swap-state-server --shm-size 64G --listen unix:///run/swap-state/swap-state.sock \\
          --token-file /etc/swap-state/token --snapshot-dir /ckpt/swap-state --metrics-port 9464
      swap-state-server --shm-size 8G --listen tcp://0.0.0.0:7070 \\
          --tls-cert server.pem --tls-key server.key

    In Docker, give the server container a shared-memory mount at least as large as
    --shm-size (docker run --shm-size 64g, or shm_size: 64g in compose) and share its IPC
    namespace with the trainers (ipc: shareable / ipc: service:<server>).
    """
)


def _size(text: str) -> int:
    try:
        return parse_size(text.removesuffix("/s"))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _metrics(text: str) -> tuple[str | None, int]:
    host, sep, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PORT or HOST:PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {text!r}")
    return (host.strip("[]") if sep else None), number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swap-state-server",
        description=textwrap.fill(
            "The per-host swap-state server: owns the shared-memory segments that hold "
            "optimizer state for the trainers on this host, and serves the gRPC control plane "
            "(attach, allocate, commit-step, snapshot, stats). It never touches an accelerator.",
            width=78,
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--shm-size", type=_size, required=True, metavar="SIZE",
        help="Whole host budget for all segments (K/M/G/T suffixes, binary). Checked against "
        "the shm directory at start; the server exits with an error if it does not fit and "
        "never falls back to disk. e.g. --shm-size 64G")
    add("--listen", default=None, metavar="ADDRESS",
        help=f"Where to serve: unix:///path (socket file mode 0660) or tcp://host:port (needs "
        f"--tls-cert/--tls-key or --insecure). Default: {default_listen()} "
        "(under $XDG_RUNTIME_DIR if set, else /run). e.g. --listen unix:///run/swap-state/s.sock")
    add("--token-file", type=pathlib.Path, default=None, metavar="PATH",
        help="File holding a bearer token; clients must send 'authorization: Bearer <token>' "
        "or get UNAUTHENTICATED (the health service is exempt). e.g. --token-file "
        "/etc/swap-state/token")
    add("--snapshot-dir", type=pathlib.Path, default=None, metavar="DIR",
        help="Directory for durable snapshots (safetensors + manifest per job and step); "
        "created if missing. Without it, snapshots are refused. e.g. --snapshot-dir "
        "/ckpt/swap-state")
    add("--grace", type=_seconds, default=30.0, metavar="SECONDS",
        help="How long a session whose trainer vanished (KeepAlive stream closed) keeps its "
        "segment for the same job/rank to reattach (default 30). e.g. --grace 120")
    add("--metrics-port", type=_metrics, default=(None, 0), metavar="[HOST:]PORT",
        help="Serve Prometheus metrics (text format) at http://HOST:PORT/metrics; 0 turns "
        "them off (default). HOST defaults to all interfaces. e.g. --metrics-port 9464 or "
        "--metrics-port 127.0.0.1:9464")
    add("--log-level", choices=LOG_LEVELS, default="info",
        help="Structured (key=value) log verbosity on stderr (default info). "
        "e.g. --log-level debug")
    add("--shm-dir", type=pathlib.Path, default=pathlib.Path("/dev/shm"), metavar="DIR",
        help="Memory filesystem (tmpfs) for the segment files (default /dev/shm); the trainers "
        "must see the same directory. e.g. --shm-dir /dev/shm")
    add("--shm-group", default=None, metavar="GROUP",
        help="Group (name or gid) given to segment files and the socket; segments become "
        "0660 instead of 0600 so trainers running as another user in that group can map "
        "them. e.g. --shm-group trainers")
    add("--chunk-bytes", type=_size, default=64 << 20, metavar="SIZE",
        help="Snapshot granularity and copy-before-write slot size; a multiple of the page "
        "size (default 64M). e.g. --chunk-bytes 32M")
    add("--cow-budget", type=_size, default=None, metavar="SIZE",
        help="Host-wide copy-before-write pool that lets snapshots run while trainers keep "
        "stepping; split into per-session slots of --chunk-bytes and held back from "
        "--shm-size (default min(1G, shm-size/8)). e.g. --cow-budget 2G")
    add("--persist-max-bandwidth", type=_size, default=0, metavar="BYTES_PER_S",
        help="Upper bound for snapshot writes to --snapshot-dir in bytes/s (suffixes allowed); "
        "0 means unlimited (default). e.g. --persist-max-bandwidth 2G")
    add("--keep-latest", type=int, default=2, metavar="K",
        help="Durable snapshots kept per job, at least 2 (older ones are removed only after "
        "a newer one is durable; default 2). e.g. --keep-latest 3")
    add("--tls-cert", type=pathlib.Path, default=None, metavar="PEM",
        help="TLS certificate chain for --listen tcp://... e.g. --tls-cert /etc/swap-state/server.pem")
    add("--tls-key", type=pathlib.Path, default=None, metavar="PEM",
        help="TLS private key for --listen tcp://... e.g. --tls-key /etc/swap-state/server.key")
    add("--insecure", action="store_true",
        help="Allow --listen tcp://... without TLS (tokens and control messages in plaintext; "
        "bulk data never crosses gRPC). e.g. --listen tcp://127.0.0.1:7070 --insecure")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    metrics_host, metrics_port = args.metrics_port
    extra: dict[str, object] = {}
    if args.listen is not None:
        extra["listen"] = args.listen
    if metrics_host:
        extra["metrics_host"] = metrics_host
    return ServerConfig(
        shm_size=args.shm_size,
        token_file=args.token_file,
        snapshot_dir=args.snapshot_dir,
        grace=args.grace,
        metrics_port=metrics_port,
        log_level=args.log_level,
        shm_dir=args.shm_dir,
        shm_group=args.shm_group,
        chunk_bytes=args.chunk_bytes,
        cow_budget=args.cow_budget,
        persist_max_bandwidth=args.persist_max_bandwidth,
        keep_latest=args.keep_latest,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        insecure=args.insecure,
        **extra,  # type: ignore[arg-type]
    )


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Flags -> config; exits 2 with a usage message on bad flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
        raise AssertionError("unreachable")  # parser.error exits


async def _serve(config: ServerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        log_event(log, "signal", signal=signal.Signals(signum).name,
                  action="stopping" if not stop.is_set() else "already stopping")
        stop.set()

    # Installed before start-up so a signal during start still ends in a clean stop.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    running = await start_server(config)
    await stop.wait()
    await running.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level)
    try:
        return asyncio.run(_serve(config))
    except StartupError as exc:
        log_event(log, "startup_failed", logging.ERROR, error=str(exc))
        print(f"swap-state-server: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
