"""Typed exceptions of the trainer's side, one per reason the server sends.

The server refuses a call with a status code and, in the trailing metadata key
``swap-state-reason`` (:data:`swap_state.common.errors.REASON_METADATA_KEY`), the reason of the
domain error that refused it. :func:`error_for` picks the class here, so callers can catch
what they can act on (``except SnapshotBusyError``: wait and retry) instead of comparing
status codes, several of which share FAILED_PRECONDITION. Imports grpc, not torch.
"""

from __future__ import annotations

import grpc

from swap_state.common.errors import REASON_METADATA_KEY

__all__ = [
    "SwapStateError",
    "ServerUnavailableError",
    "SessionLostError",
    "InvalidRequestError",
    "NotFoundError",
    "SnapshotNotFoundError",
    "BudgetExhaustedError",
    "DiskFullError",
    "StaleGenerationError",
    "SessionLiveError",
    "MetadataBaseUnknownError",
    "LayoutMismatchError",
    "NoSegmentError",
    "SnapshotsDisabledError",
    "SnapshotBusyError",
    "SnapshotExistsError",
    "SnapshotFailedError",
    "SnapshotCorruptError",
    "StoreUnavailableError",
    "UnauthenticatedError",
    "ERROR_FOR_REASON",
    "error_for",
    "reason_of",
]


class SwapStateError(RuntimeError):
    """A swap-state call failed. ``code``: the gRPC status code (None for local errors);
    ``reason``: the server's machine-readable reason (None when it sent none)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, reason: str | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason


class ServerUnavailableError(SwapStateError):
    """The server could not be reached within the deadline (or is shutting down)."""


class SessionLostError(SwapStateError):
    """The session's keep-alive stream ended: the server died or dropped the session."""


class InvalidRequestError(SwapStateError):
    """The server refused the request as malformed (an id, a shape, a size)."""


class NotFoundError(SwapStateError):
    """The server does not have the session (or object) the call names."""


class SnapshotNotFoundError(NotFoundError):
    """No complete snapshot under that id (retention, another --snapshot-dir, another host)."""


class BudgetExhaustedError(SwapStateError):
    """The request does not fit into the server's --shm-size budget."""


class DiskFullError(SwapStateError):
    """The snapshot directory ran out of space."""


class StaleGenerationError(SwapStateError):
    """This client's generation is not current: another trainer reattached the session."""


class SessionLiveError(SwapStateError):
    """The job id and rank are attached by another live trainer."""


class LayoutMismatchError(SwapStateError):
    """A segment or snapshot does not fit these tensors (names, dtypes, shapes, ranks)."""


class NoSegmentError(SwapStateError):
    """The session has no segment yet (Allocate first)."""


class MetadataBaseUnknownError(SwapStateError):
    """The server does not hold the snapshot metadata base this session sent (it restarted):
    the client sends it again."""


class SnapshotsDisabledError(SwapStateError):
    """The server keeps no snapshots (started without --snapshot-dir)."""


class SnapshotBusyError(SwapStateError):
    """The segment cannot be snapshotted or restored now; retrying later may succeed."""


class SnapshotExistsError(SwapStateError):
    """A complete snapshot of that job and step is already on disk."""


class SnapshotFailedError(SwapStateError):
    """A snapshot failed: the one being joined (another rank's error), or one waited for
    (its status names the cause)."""


class SnapshotCorruptError(SwapStateError):
    """A snapshot file does not verify; the message names the file and tensor."""


class StoreUnavailableError(SwapStateError):
    """The server's snapshot store (--snapshot-store) cannot be reached; the message names it."""


class UnauthenticatedError(SwapStateError):
    """Missing or wrong token (the server's --token-file, the trainer's $SWAP_STATE_TOKEN_FILE)."""


ERROR_FOR_REASON: dict[str, type[SwapStateError]] = {
    "INVALID_ARGUMENT": InvalidRequestError,
    "NOT_FOUND": NotFoundError,
    "SNAPSHOT_NOT_FOUND": SnapshotNotFoundError,
    "RESOURCE_EXHAUSTED": BudgetExhaustedError,
    "DISK_FULL": DiskFullError,
    "FAILED_PRECONDITION": SwapStateError,
    "STALE_GENERATION": StaleGenerationError,
    "SESSION_LIVE": SessionLiveError,
    "LAYOUT_MISMATCH": LayoutMismatchError,
    "NO_SEGMENT": NoSegmentError,
    "METADATA_BASE_UNKNOWN": MetadataBaseUnknownError,
    "SNAPSHOTS_DISABLED": SnapshotsDisabledError,
    "SNAPSHOT_BUSY": SnapshotBusyError,
    "SNAPSHOT_EXISTS": SnapshotExistsError,
    "SNAPSHOT_FAILED": SnapshotFailedError,
    "SNAPSHOT_CORRUPT": SnapshotCorruptError,
    "STORE_UNAVAILABLE": StoreUnavailableError,
    "SNAPSHOT_ERROR": SwapStateError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "UNAVAILABLE": ServerUnavailableError,
    "INTERNAL": SwapStateError,
}
"""Every reason of :mod:`swap_state.common.errors` and its snapshot errors (a test checks)."""


def reason_of(error: grpc.RpcError) -> str | None:
    """The ``swap-state-reason`` trailing metadata of a failed call, if the server sent one."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == REASON_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def error_for(reason: str | None, message: str, code: grpc.StatusCode | None) -> SwapStateError:
    """The typed exception for ``reason`` (plain :class:`SwapStateError` for an unknown one)."""
    cls = ERROR_FOR_REASON.get(reason or "", SwapStateError)
    return cls(message, code, reason)
