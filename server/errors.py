"""Domain errors of the state server.

The domain modules (arena, sessions, validation, config) raise these; the transport layer
maps them to gRPC status codes in exactly one place (:mod:`swap_state.server.statuses`).
This module imports neither grpc nor protobuf, so the domain stays transport-free.
"""

from __future__ import annotations

__all__ = [
    "DomainError",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "FailedPrecondition",
    "Unauthenticated",
    "Unimplemented",
    "Unavailable",
    "ConfigError",
    "StartupError",
]


class DomainError(Exception):
    """A request the server refuses for a reason the caller can act on."""


class InvalidArgument(DomainError):
    """The request itself is malformed (ids, shapes, dtypes, sizes)."""


class NotFound(DomainError):
    """The request names a session (or other object) the server does not have."""


class ResourceExhausted(DomainError):
    """The request does not fit into the budget (or the shm filesystem is full)."""


class FailedPrecondition(DomainError):
    """The request is well formed but the session is not in a state that allows it
    (stale generation, step going backwards, no segment yet, a live session elsewhere)."""


class Unauthenticated(DomainError):
    """Missing or wrong bearer token."""


class Unimplemented(DomainError):
    """The RPC exists in the protocol but this server build does not serve it yet."""


class Unavailable(DomainError):
    """The server is shutting down."""


class ConfigError(ValueError):
    """A configuration value is invalid (the CLI reports it as a usage error, exit 2)."""


class StartupError(RuntimeError):
    """The server cannot start in this environment (exit 1, with a message saying what to do)."""
