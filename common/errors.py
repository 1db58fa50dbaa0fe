"""Domain errors, and the machine-readable reason each one carries over the wire.

The domain modules (arena, sessions, validation, snapshots) raise these; the server's transport
layer maps them to gRPC status codes in exactly one place (:mod:`swap_state.server.rpc.statuses`)
and sends :attr:`DomainError.reason` in the trailing-metadata key :data:`REASON_METADATA_KEY`;
the client turns the reason back into a typed exception (:mod:`swap_state.client.errors`).

Every class names its status ``code`` (a ``grpc.StatusCode`` member name, so this module needs
no grpc) and its ``reason`` (an upper-case word the client maps to an exception class). Imports neither grpc nor torch.
"""

from __future__ import annotations

__all__ = [
    "REASON_METADATA_KEY",
    "DomainError",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "FailedPrecondition",
    "StaleGeneration",
    "SessionLive",
    "LayoutMismatch",
    "NoSegment",
    "MetadataBaseUnknown",
    "SnapshotsDisabled",
    "Unauthenticated",
    "Unavailable",
    "ConfigError",
    "StartupError",
    "SERVER_STOPPING_NOTICE",
]

REASON_METADATA_KEY = "swap-state-reason"
"""Trailing-metadata key of a refused call: the refusing error's ``reason``."""

SERVER_STOPPING_NOTICE = "shutting down"
"""The last KeepAlive event's notice of a server that stops (SIGTERM): its trainers keep
stepping and reconnect to the next server, which adopts their segments."""


class DomainError(Exception):
    """A request the server refuses for a reason the caller can act on."""

    code = "INTERNAL"
    reason = "INTERNAL"


class InvalidArgument(DomainError):
    """The request itself is malformed (ids, shapes, dtypes, sizes)."""

    code = reason = "INVALID_ARGUMENT"


class NotFound(DomainError):
    """The request names a session (or other object) the server does not have."""

    code = reason = "NOT_FOUND"


class ResourceExhausted(DomainError):
    """The request does not fit into the budget (or the shm filesystem is full)."""

    code = reason = "RESOURCE_EXHAUSTED"


class FailedPrecondition(DomainError):
    """The request is well formed but the session is not in a state that allows it
    (step going backwards, a refused snapshot step)."""

    code = reason = "FAILED_PRECONDITION"


class StaleGeneration(FailedPrecondition):
    """The caller's generation is not the session's current one: another trainer reattached."""

    reason = "STALE_GENERATION"


class SessionLive(FailedPrecondition):
    """The job/rank is attached by a live trainer (same job id and rank twice?)."""

    reason = "SESSION_LIVE"


class LayoutMismatch(FailedPrecondition):
    """A segment or snapshot does not fit the requested tensors (names, dtypes, shapes, ranks)."""

    reason = "LAYOUT_MISMATCH"


class NoSegment(FailedPrecondition):
    """The session has no segment yet: Allocate first."""

    reason = "NO_SEGMENT"


class MetadataBaseUnknown(FailedPrecondition):
    """A snapshot names a metadata base this server does not hold (it restarted since the
    trainer sent it): send the base again."""

    reason = "METADATA_BASE_UNKNOWN"


class SnapshotsDisabled(FailedPrecondition):
    """The server was started without ``--snapshot-dir``."""

    reason = "SNAPSHOTS_DISABLED"


class Unauthenticated(DomainError):
    """Missing or wrong bearer token."""

    code = reason = "UNAUTHENTICATED"


class Unavailable(DomainError):
    """The server is shutting down."""

    code = reason = "UNAVAILABLE"


class ConfigError(ValueError):
    """A configuration value is invalid (the CLI reports it as a usage error, exit 2)."""


class StartupError(RuntimeError):
    """The server cannot start in this environment (exit 1, with a message saying what to do)."""

