"""Domain errors, and the machine-readable reason each one carries over the wire.

The server maps each class's ``code`` (a ``grpc.StatusCode`` member name) to its status in one
place (:mod:`swap_state.server.rpc.statuses`) and sends its ``reason`` in
:data:`REASON_METADATA_KEY`; the client raises the same class again (:data:`ERROR_FOR_REASON`).
"""

from __future__ import annotations

__all__ = [
    "REASON_METADATA_KEY", "SwapStateError", "ERROR_FOR_REASON", "InvalidRequestError", "NotFoundError",
    "BudgetExhaustedError", "FailedPreconditionError", "StaleGenerationError", "SessionLiveError", "LayoutMismatchError",
    "NoSegmentError", "MetadataBaseUnknownError", "SnapshotsDisabledError", "PermissionDeniedError",
    "UnauthenticatedError", "ServerUnavailableError", "ConfigError", "StartupError", "SERVER_STOPPING_NOTICE"]

REASON_METADATA_KEY = "swap-state-reason"
"""Trailing-metadata key of a refused call: the refusing error's ``reason``."""

SERVER_STOPPING_NOTICE = "shutting down"
"""The last KeepAlive event's notice of a server that stops (SIGTERM): trainers reconnect."""


ERROR_FOR_REASON: dict[str, type[SwapStateError]] = {}
"""Each reason and the class that declared it first: the one a client raises for it."""


class SwapStateError(RuntimeError):
    """A swap-state call failed for a reason the caller can act on (on the client: raised again
    from the reason received). ``code``: the status code (the client's: the ``grpc.StatusCode``
    received, None for a local error); ``reason``: the machine-readable reason. A subclass
    declares them as class keywords: ``class E(SwapStateError, code=..., reason=...)``."""

    code: object = "INTERNAL"
    reason: str | None = "INTERNAL"

    def __init__(self, message: str = "", code: object = None, reason: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if reason is not None:
            self.reason = reason

    def __init_subclass__(cls, code: object = None, reason: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if reason is not None:
            cls.reason = reason
        if isinstance(cls.__dict__.get("reason"), str):
            ERROR_FOR_REASON.setdefault(cls.reason, cls)


ERROR_FOR_REASON["INTERNAL"] = SwapStateError


class InvalidRequestError(SwapStateError, code="INVALID_ARGUMENT", reason="INVALID_ARGUMENT"):
    """The request itself is malformed (ids, shapes, dtypes, sizes)."""


class NotFoundError(SwapStateError, code="NOT_FOUND", reason="NOT_FOUND"):
    """The request names a session (or other object) the server does not have."""


class BudgetExhaustedError(SwapStateError, code="RESOURCE_EXHAUSTED", reason="RESOURCE_EXHAUSTED"):
    """The request does not fit into the budget (or the shm filesystem is full)."""


class FailedPreconditionError(SwapStateError, code="FAILED_PRECONDITION", reason="FAILED_PRECONDITION"):
    """The request is well formed but the session is not in a state that allows it
    (step going backwards, a refused snapshot step)."""


class StaleGenerationError(FailedPreconditionError, reason="STALE_GENERATION"):
    """The caller's generation is not the session's current one: another trainer reattached."""


class SessionLiveError(FailedPreconditionError, reason="SESSION_LIVE"):
    """The job/rank is attached by a live trainer (same job id and rank twice?)."""


class LayoutMismatchError(FailedPreconditionError, reason="LAYOUT_MISMATCH"):
    """A segment or snapshot does not fit the requested tensors (names, dtypes, shapes, ranks)."""


class NoSegmentError(FailedPreconditionError, reason="NO_SEGMENT"):
    """The session has no segment yet: Allocate first."""


class MetadataBaseUnknownError(FailedPreconditionError, reason="METADATA_BASE_UNKNOWN"):
    """A snapshot names a metadata base this server does not hold (restarted): send it again."""


class ReplicaPeersUnsetError(FailedPreconditionError, reason="REPLICA_PEERS_UNSET"):
    """A memory-only snapshot asked of a server without ``--replica-peers``."""


class SnapshotsDisabledError(FailedPreconditionError, reason="SNAPSHOTS_DISABLED"):
    """The server was started without ``--snapshot-dir``."""


class PermissionDeniedError(SwapStateError, code="PERMISSION_DENIED", reason="PERMISSION_DENIED"):
    """The caller's tenant (``--tenants``) may not use another tenant's job, session or snapshot."""


class UnauthenticatedError(SwapStateError, code="UNAUTHENTICATED", reason="UNAUTHENTICATED"):
    """Missing or wrong bearer token."""


class ServerUnavailableError(SwapStateError, code="UNAVAILABLE", reason="UNAVAILABLE"):
    """The server is shutting down, or (on the client) cannot be reached within the deadline."""


class ConfigError(ValueError):
    """A configuration value is invalid (the CLI reports it as a usage error, exit 2)."""


class StartupError(RuntimeError):
    """The server cannot start in this environment (exit 1, with a message saying what to do)."""

