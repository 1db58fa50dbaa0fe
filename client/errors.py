"""The exceptions a trainer catches (the common errors, one name each), raised again from the
``swap-state-reason`` trailing metadata the server sends (:func:`error_for`).
"""

from __future__ import annotations

import grpc

from swap_state.common.errors import (
    ERROR_FOR_REASON, REASON_METADATA_KEY, FailedPreconditionError, InvalidRequestError, LayoutMismatchError,
    MetadataBaseUnknownError, NoSegmentError, NotFoundError, PermissionDeniedError, BudgetExhaustedError,
    SessionLiveError, SnapshotsDisabledError, StaleGenerationError, SwapStateError, UnauthenticatedError,
    ServerUnavailableError)
from swap_state.common.snapshot_errors import (
    SnapshotBusyError, SnapshotCorruptError, DiskFullError, SnapshotExistsError, SnapshotFailedError,
    SnapshotNotFoundError, StoreUnavailableError)

__all__ = [
    "SwapStateError", "ServerUnavailableError", "SessionLostError", "InvalidRequestError", "NotFoundError",
    "SnapshotNotFoundError", "BudgetExhaustedError", "DiskFullError", "FailedPreconditionError", "StaleGenerationError",
    "SessionLiveError", "MetadataBaseUnknownError", "LayoutMismatchError", "NoSegmentError", "SnapshotsDisabledError",
    "SnapshotBusyError", "SnapshotExistsError", "SnapshotFailedError", "SnapshotCorruptError", "StoreUnavailableError",
    "PermissionDeniedError", "UnauthenticatedError", "ERROR_FOR_REASON", "error_for", "reason_of"]


class SessionLostError(SwapStateError):
    """The server dropped the session (the client's own finding; no server sends it)."""

    code = reason = None


def reason_of(error: grpc.RpcError) -> str | None:
    """The ``swap-state-reason`` trailing metadata of a failed call, if the server sent one."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == REASON_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def error_for(reason: str | None, message: str, code: grpc.StatusCode | None) -> SwapStateError:
    """The exception of the class that declared ``reason`` (else :class:`SwapStateError`)."""
    error = ERROR_FOR_REASON.get(reason or "", SwapStateError)(message, code)
    error.reason = reason
    return error
