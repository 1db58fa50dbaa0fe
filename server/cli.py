"""``swap-state-server``: parse flags into :class:`ServerConfig`, run until SIGTERM/SIGINT. Exit codes:
0 after a clean stop, 1 when the environment does not allow starting, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import textwrap

from swap_state.common.errors import StartupError
from swap_state.common.server_config import EXIT_WITH_PARENT_ENV, ServerConfig
from swap_state.common.server_flags import add_server_flags, parse_server_argv
from swap_state.server import _posix
from swap_state.server.logs import configure_logging, log_event
from swap_state.server.runtime import start_server

__all__ = ["build_parser", "main", "parse_config"]

log = logging.getLogger(__name__)

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
    namespace with the trainers (ipc: shareable / ipc: service:<server>; so that a restarted
    or upgraded server adopts the trainers' segments, let a container that outlives the
    server own it, as docker/compose.yaml's shm service does).
    """
)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and epilog as written; help wrapped without breaking paths and flags at hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """The ``swap-state-server`` parser: a flag per :class:`ServerConfig` flag field."""
    parser = argparse.ArgumentParser(
        prog="swap-state-server",
        description=textwrap.fill(
            "The per-host swap-state server: owns the shared-memory segments that hold "
            "optimizer state for the trainers on this host, and serves the gRPC control plane "
            "(attach, allocate, commit-step, snapshot, stats). It never touches an accelerator.",
            width=78),
        epilog=_EPILOG,
        formatter_class=_HelpFormatter)
    add_server_flags(parser)
    return parser


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Flags -> config; exits 2 with a usage message on bad flags."""
    return parse_server_argv(argv, build_parser())


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


def _exit_with_parent() -> None:
    """An embedded server (``EXIT_WITH_PARENT_ENV`` names its trainer's pid) stops when its
    trainer dies, also when that happened before this line."""
    parent = os.environ.get(EXIT_WITH_PARENT_ENV, "")
    if not parent.isdigit():
        return
    _posix.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    _exit_with_parent()
    config = parse_config(argv)
    configure_logging(config.log_level)
    try:
        return asyncio.run(_serve(config))
    except StartupError as exc:
        print(f"swap-state-server: error: {exc}", file=sys.stderr)  # once: the log goes to stderr too
        return 1


if __name__ == "__main__":
    sys.exit(main())
