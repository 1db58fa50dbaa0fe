"""The replica tier's wire between two servers: one TCP connection per writing thread, mutual TLS where the flags give
it (``--replica-tls-*``), a mutual HMAC handshake on the secret both hold where they give one
(``--replica-secret-file``), then frames: a fixed header (magic, kind, length) and a JSON control message or raw data.
Every frame is bounded before it is read, nothing is unpickled, every socket operation has a timeout. The chosen
transport and the measurement behind it: docs/replica_transport.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import pathlib
import secrets
import socket
import ssl
import stat
import struct
from typing import Any

from swap_state.common.addresses import ListenAddress
from swap_state.common.errors import StartupError
from swap_state.common.server_config import SnapshotSettings
from swap_state.common.snapshot_errors import SnapshotError
from swap_state.common.snapshot_format import MAX_LAYOUT_BYTES
from swap_state.server.tenants import read_secret_file

__all__ = ["CONNECT_TIMEOUT_S", "Connection", "DATA_FRAME_BYTES", "PeerCredentials", "ReplicaRefused", "WireError",
           "accept_sender", "connect_to_peer", "peer_credentials", "read_secret"]

_MAGIC = b"SSR1"
_HEADER = struct.Struct("!4sBQ")  # magic, kind, payload length
_CONTROL, _DATA = 1, 2
DATA_FRAME_BYTES = 8 << 20  # a data frame's most bytes (a sink's room)
_MAX_CONTROL_BYTES = MAX_LAYOUT_BYTES + (1 << 20)  # a commit carries the step's layout index
IO_TIMEOUT_S = 60.0  # the longest a peer may leave a frame unsent or unread
CONNECT_TIMEOUT_S = 3.0  # a lost peer is passed over quickly: a snapshot or a restore has other places to go
_VERSION = 1
_SOCKET_BUFFER_BYTES = 4 << 20


class WireError(SnapshotError):
    """The connection broke, timed out, or the other side broke the protocol."""


class ReplicaRefused(SnapshotError):
    """The peer answered with a refusal."""


def read_secret(path: pathlib.Path, flag: str = "--replica-secret-file") -> bytes:
    """The shared secret in ``path``: at least 16 bytes, readable by its owner only; StartupError."""
    info, text = read_secret_file(path, flag)
    secret = text.strip().encode()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(f"{flag} {path} holds a secret and others may read it: chmod 600 {path}")
    if len(secret) < 16:
        raise StartupError(f"{flag} {path} holds {len(secret)} bytes: a secret needs at least 16 "
                           f"(e.g. head -c 32 /dev/urandom | base64 > {path})")
    return secret


class Connection:
    """Frames over one connected socket."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.settimeout(IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
        self.sock, self.peer = sock, peer
        self.authenticated = False  # until then a frame is small: an unknown caller allocates nothing much
        self._data = bytearray(0)  # data frames land here, reused: fresh memory is slower to fill

    def close(self) -> None:
        self.sock.close()

    def send(self, message: dict[str, Any]) -> None:
        self._send(_CONTROL, json.dumps(message, allow_nan=False).encode())

    def send_data(self, data: bytes | memoryview) -> None:
        if len(data) > DATA_FRAME_BYTES:
            raise ValueError(f"a data frame holds at most {DATA_FRAME_BYTES} bytes")
        self._send(_DATA, data)

    def request(self, message: dict[str, Any], data: bytes | memoryview | None = None) -> dict[str, Any]:
        """Send ``message`` (and ``data``), then the peer's answer; ReplicaRefused when it refused."""
        self.send(message)
        if data is not None:
            self.send_data(data)
        answer = self.receive()
        if not answer.get("ok"):
            raise ReplicaRefused(f"replica peer {self.peer} refused {message.get('op')}: {answer.get('error')}")
        return answer

    def receive(self) -> dict[str, Any]:
        """The next control message (a dict)."""
        message = self.receive_frame()
        if not isinstance(message, dict):
            raise WireError(f"replica peer {self.peer} sent data where a control message belongs")
        return message

    def receive_frame(self, data_limit: int = DATA_FRAME_BYTES) -> dict[str, Any] | memoryview:
        """The next frame: a control message, or data (at most ``data_limit`` bytes; valid until the next receive)."""
        magic, kind, length = _HEADER.unpack(self._exactly(_HEADER.size))
        limits = {_CONTROL: _MAX_CONTROL_BYTES, _DATA: data_limit} if self.authenticated else {_CONTROL: 4096}
        limit = limits.get(kind, -1) if magic == _MAGIC else -1
        if length > limit:
            raise WireError(f"replica peer {self.peer} sent a frame of kind {kind} and {length} bytes: "
                            "not the protocol, or over its limit")
        if kind == _DATA:
            if length > len(self._data):
                self._data = bytearray(max(length, min(DATA_FRAME_BYTES, 2 * len(self._data) or 1 << 20)))
            view = memoryview(self._data)[:length]
            self._fill(view)
            return view
        payload = self._exactly(length)
        try:
            message = json.loads(payload)
        except ValueError:
            raise WireError(f"replica peer {self.peer} sent a control frame that is not JSON") from None
        if not isinstance(message, dict):
            raise WireError(f"replica peer {self.peer} sent a control frame that is not an object")
        return message

    def receive_data(self, limit: int = DATA_FRAME_BYTES) -> memoryview:
        """The next data frame (valid until the next receive)."""
        data = self.receive_frame(limit)
        if isinstance(data, dict):
            raise WireError(f"replica peer {self.peer} sent a control message where data belongs")
        return data

    def _send(self, kind: int, payload: bytes | memoryview) -> None:
        try:
            self.sock.sendall(_HEADER.pack(_MAGIC, kind, len(payload)))
            self.sock.sendall(payload)
        except OSError as exc:
            raise WireError(f"sending to replica peer {self.peer} failed: {_why(exc)}") from None

    def _exactly(self, nbytes: int) -> bytearray:
        buffer = bytearray(nbytes)
        with memoryview(buffer) as view:
            self._fill(view)
        return buffer

    def _fill(self, view: memoryview) -> None:
        done = 0
        try:
            while done < view.nbytes:
                got = self.sock.recv_into(view[done:], view.nbytes - done)
                if got == 0:
                    raise WireError(f"replica peer {self.peer} closed the connection")
                done += got
        except OSError as exc:  # a timeout included
            raise WireError(f"receiving from replica peer {self.peer} failed: {_why(exc)}") from None


def _why(exc: OSError) -> str:
    """A broken connection's cause; a refused certificate names the flags (with TLS 1.3 the peer's
    verdict on this side's certificate arrives with its first message, not in the handshake)."""
    return f"{exc}: {_TLS_REFUSED}" if _certificate_refused(exc) else str(exc)


_TLS_REFUSED = "mutual TLS failed (--replica-tls-*: both sides' certificates and roots)"


def _certificate_refused(exc: OSError) -> bool:
    """Whether ``exc`` is a certificate this side or the peer refused (not a broken connection)."""
    return isinstance(exc, ssl.SSLCertVerificationError) or (
        isinstance(exc, ssl.SSLError) and any(word in str(exc.reason) for word in ("CERTIFICATE", "UNKNOWN_CA")))


def _proof(secret: bytes, role: bytes, sender_nonce: str, peer_nonce: str) -> str:
    return hmac.new(secret, b"|".join((role, sender_nonce.encode(), peer_nonce.encode())), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class PeerCredentials:
    """What replica peers prove to each other: the shared secret (HMAC), mutual TLS, or both."""

    secret: bytes | None = None
    connecting: ssl.SSLContext | None = None  # mutual TLS as the side that connects
    accepting: ssl.SSLContext | None = None  # and as the side that accepts

    def __post_init__(self) -> None:
        if self.secret is None and (self.connecting is None or self.accepting is None):
            raise ValueError("replica peers need a secret or mutual TLS: a wire open to anyone is never made")


def peer_credentials(settings: SnapshotSettings) -> PeerCredentials:
    """The credentials the flags name (``--replica-secret-file``, ``--replica-tls-*``); StartupError."""
    secret = read_secret(settings.replica_secret_file) if settings.replica_secret_file is not None else None
    if settings.replica_tls is None:
        return PeerCredentials(secret)
    cert, key, roots = settings.replica_tls
    if key.exists() and key.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(f"--replica-tls-key {key} is a private key others may read: chmod 600 {key}")

    def encrypted() -> str:
        raise StartupError(f"--replica-tls-key {key} is encrypted: give the key unencrypted (mode 0600)")

    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_CLIENT, ssl.PROTOCOL_TLS_SERVER):
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED  # both sides present a certificate the roots signed
        try:
            context.load_cert_chain(cert, key, password=encrypted)
            context.load_verify_locations(roots)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"--replica-tls-cert {cert}, --replica-tls-key {key}, --replica-tls-ca {roots}: "
                               f"cannot load them: {exc}") from None
        contexts.append(context)
    return PeerCredentials(secret, *contexts)


def connect_to_peer(peer: ListenAddress, credentials: PeerCredentials, timeout_s: float = 10.0) -> Connection:
    """A connection to ``peer`` after both proved who they are; WireError / ReplicaRefused."""
    try:
        sock = socket.create_connection((peer.host, peer.port), timeout=timeout_s)
    except OSError as exc:
        raise WireError(f"cannot reach replica peer {peer.url}: {exc}") from None
    if credentials.connecting is not None:
        try:
            sock = credentials.connecting.wrap_socket(sock, server_hostname=peer.host)
        except OSError as exc:  # ssl.SSLError and CertificateError included
            sock.close()
            if _certificate_refused(exc):
                raise ReplicaRefused(f"replica peer {peer.url}: {exc}: {_TLS_REFUSED}") from None
            raise WireError(f"cannot reach replica peer {peer.url} over TLS: {exc}") from None
    try:
        conn = Connection(sock, peer.url)
    except OSError as exc:
        sock.close()
        raise WireError(f"cannot reach replica peer {peer.url}: {exc}") from None
    try:
        nonce = secrets.token_hex(16)
        # Over TLS 1.3 the peer judges this side's certificate after the handshake, and its close can
        # arrive before its alert: a hello cut short over TLS is named as the refusal it most likely is.
        try:
            conn.send({"op": "hello", "version": _VERSION, "nonce": nonce, "pid": os.getpid()})
            challenge = conn.receive()
        except WireError as exc:
            if credentials.connecting is None or _TLS_REFUSED in str(exc):
                raise
            raise WireError(f"{exc}; the peer ended TLS before its first answer: {_TLS_REFUSED}") from None
        if not challenge.get("ok"):
            raise ReplicaRefused(f"replica peer {peer.url} refused the connection: {challenge.get('error')}")
        peer_nonce, secret = str(challenge.get("nonce", "")), credentials.secret
        if secret is not None and not hmac.compare_digest(str(challenge.get("proof", "")),
                                                          _proof(secret, b"peer", nonce, peer_nonce)):
            raise ReplicaRefused(f"replica peer {peer.url} does not hold this server's --replica-secret-file")
        conn.request({"op": "auth", "proof": _proof(secret, b"sender", nonce, peer_nonce) if secret else ""})
        conn.authenticated = True
    except BaseException:
        conn.close()
        raise
    return conn


def accept_sender(sock: socket.socket, peer: str, credentials: PeerCredentials) -> Connection:
    """The peer's side of the handshake: the connection once the sender proved who it is;
    WireError (answered first where the wire allows) when it did not."""
    if credentials.accepting is not None:
        sock.settimeout(IO_TIMEOUT_S)
        try:
            sock = credentials.accepting.wrap_socket(sock, server_side=True)
        except OSError as exc:  # ssl.SSLError included
            sock.close()
            raise WireError(f"replica sender {peer}: {_why(exc)}") from None
    try:
        conn = Connection(sock, peer)
        _authenticate_sender(conn, credentials.secret)
    except OSError as exc:
        sock.close()
        raise WireError(f"replica sender {peer}: {exc}") from None
    except BaseException:
        sock.close()  # the TLS socket, when wrapped
        raise
    return conn


def _authenticate_sender(conn: Connection, secret: bytes | None) -> None:
    hello = conn.receive()
    if hello.get("op") != "hello" or hello.get("version") != _VERSION:
        conn.send({"ok": False, "reason": "version", "error": f"expected protocol version {_VERSION}"})
        raise WireError(f"replica sender {conn.peer} speaks another protocol: {str(hello)[:80]}")
    sender_nonce, nonce = str(hello.get("nonce", "")), secrets.token_hex(16)
    conn.send({"ok": True, "nonce": nonce, "proof": _proof(secret, b"peer", sender_nonce, nonce) if secret else ""})
    auth = conn.receive()
    if secret is not None and not hmac.compare_digest(str(auth.get("proof", "")),
                                                      _proof(secret, b"sender", sender_nonce, nonce)):
        conn.send({"ok": False, "reason": "unauthenticated", "error": "wrong or no --replica-secret-file"})
        raise WireError(f"replica sender {conn.peer} does not hold this server's --replica-secret-file")
    conn.authenticated = True
    conn.send({"ok": True})
