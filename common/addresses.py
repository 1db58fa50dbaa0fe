"""Server addresses: one rule set for the server's ``--listen`` and the trainer's ``server=``:
``unix:///absolute/path``, a socket path (``./x.sock`` made absolute), ``tcp://host:port`` or
``tcp://[v6]:port``. ``unix://relative`` is refused: absolute to people, relative to gRPC.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import Literal

from .errors import ConfigError

__all__ = ["ListenAddress", "parse_address", "parse_peers", "default_socket_path", "default_listen", "MAX_UNIX_PATH"]

# Linux sun_path is 108 bytes including the terminating NUL.
MAX_UNIX_PATH = 107
_TCP = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([A-Za-z0-9_.-]+):(\d+)")


def default_socket_path() -> pathlib.Path:
    """$XDG_RUNTIME_DIR/swap-state/swap-state.sock, else /run/swap-state/swap-state.sock."""
    return pathlib.Path(os.environ.get("XDG_RUNTIME_DIR") or "/run") / "swap-state" / "swap-state.sock"


def default_listen() -> str:
    return f"unix://{default_socket_path()}"


@dataclasses.dataclass(frozen=True)
class ListenAddress:
    scheme: Literal["unix", "tcp"]
    path: pathlib.Path | None = None
    """The socket file (unix only), absolute and normalised."""
    host: str = ""
    """Host or address (tcp only); ``[::1]`` brackets removed."""
    port: int = 0
    """TCP port; 0 (server side) picks a free one."""

    @property
    def url(self) -> str:
        return f"unix://{self.path}" if self.scheme == "unix" else f"tcp://{self._host_port()}"

    def _host_port(self, port: int | None = None) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port if port is None else port}"

    def bind_target(self, port: int | None = None) -> str:
        """The address string grpc's ``add_*_port`` (server) or channel (client) takes."""
        return self.url if self.scheme == "unix" else self._host_port(port)


def parse_address(text: str, flag: str = "--listen") -> ListenAddress:
    """Parse ``text``; errors are :class:`ConfigError` naming ``flag`` (the setting to fix)."""
    text = str(text).strip()
    if text.startswith("tcp://"):
        match = _TCP.fullmatch(text[len("tcp://") :])
        if not match:
            raise ConfigError(f"{flag} {text!r}: expected tcp://HOST:PORT (IPv6: tcp://[::1]:PORT)")
        port = int(match.group(2) or match.group(4))
        if port > 65535:
            raise ConfigError(f"{flag} {text!r}: port out of range")
        return ListenAddress("tcp", host=match.group(1) or match.group(3), port=port)
    if text.startswith("unix://"):
        raw = text[len("unix://") :]
        if not raw.startswith("/"):
            raise ConfigError(f"{flag} {text!r}: the unix socket path must be absolute (unix:///path)")
    elif text.startswith(("/", "./", "../")):
        raw = os.path.abspath(text)
    else:
        raise ConfigError(f"{flag} {text!r}: expected unix:///path, a socket path or tcp://host:port")
    path = pathlib.Path(os.path.normpath(raw))
    if len(os.fsencode(str(path))) > MAX_UNIX_PATH:
        raise ConfigError(f"{flag} {text!r}: a unix socket path may have at most {MAX_UNIX_PATH} bytes")
    return ListenAddress("unix", path=path)


def parse_peers(text: str, flag: str = "--replica-peers") -> tuple[ListenAddress, ...]:
    """``tcp://HOST:PORT[,tcp://HOST:PORT...]``, each as its peer gives it to ``--replica-listen``."""
    peers = tuple(parse_address(part, flag) for part in text.split(",") if part.strip())
    if not peers or any(peer.scheme != "tcp" or peer.port == 0 for peer in peers):
        raise ConfigError(f"{flag} {text!r}: expected tcp://HOST:PORT, comma separated (each peer's --replica-listen)")
    return peers
