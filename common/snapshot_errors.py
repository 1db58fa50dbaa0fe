"""Domain errors of snapshots and restore, each with its ``code`` and ``reason`` like
:mod:`.errors`."""

from __future__ import annotations

import errno

from .errors import SwapStateError

__all__ = [
    "SnapshotError", "SnapshotInvalid", "SnapshotNotFoundError", "SnapshotBusyError", "SnapshotExistsError",
    "SnapshotFailedError", "SnapshotCorruptError", "SnapshotLayoutMismatch", "DiskFullError",
    "StoreUnavailableError", "from_os_error"
]


class SnapshotError(SwapStateError):
    """Base of every snapshot/restore error; also used for I/O failures without a better class."""

    code, reason = "INTERNAL", "SNAPSHOT_ERROR"


class SnapshotInvalid(SnapshotError):
    """A malformed request: job id, snapshot id, metadata_json, rank/world size."""

    code = reason = "INVALID_ARGUMENT"


class SnapshotNotFoundError(SnapshotError):
    """No complete snapshot (or no in-memory snapshot record) under that id."""

    code, reason = "NOT_FOUND", "SNAPSHOT_NOT_FOUND"


class SnapshotBusyError(SnapshotError):
    """The segment cannot be snapshotted or restored now (persisting, mid-step, cleaning up)."""

    code, reason = "FAILED_PRECONDITION", "SNAPSHOT_BUSY"


class SnapshotExistsError(SnapshotError):
    """A complete snapshot of that job and step is already on disk."""

    code, reason = "FAILED_PRECONDITION", "SNAPSHOT_EXISTS"


class SnapshotFailedError(SnapshotError):
    """The snapshot this rank tries to join has already failed (another rank's error)."""

    code, reason = "FAILED_PRECONDITION", "SNAPSHOT_FAILED"


class SnapshotCorruptError(SnapshotError):
    """A snapshot file does not verify (checksum, size, header); the message names file and tensor."""

    code, reason = "DATA_LOSS", "SNAPSHOT_CORRUPT"


class SnapshotLayoutMismatch(SnapshotError):
    """The snapshot does not fit the target: other world size, tensor names, dtypes or shapes."""

    code, reason = "FAILED_PRECONDITION", "LAYOUT_MISMATCH"


class DiskFullError(SnapshotError):
    """The snapshot directory ran out of space (ENOSPC/EDQUOT); the message names the directory."""

    code, reason = "RESOURCE_EXHAUSTED", "DISK_FULL"


class StoreUnavailableError(SnapshotError):
    """The snapshot store failed a request (unreachable, refusing, timed out); names the object."""

    code, reason = "UNAVAILABLE", "STORE_UNAVAILABLE"


def from_os_error(exc: OSError, action: str, directory: object) -> SnapshotError:
    """The domain error for an I/O failure while ``action`` in ``directory``: disk full and
    quota become DiskFullError, saying what to do."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"snapshot directory {directory} is full ({exc.strerror}) while {action}; "
                                "the snapshot was discarded and training is unaffected: free space, "
                                "lower --keep-latest or point --snapshot-dir at a larger volume")
    return SnapshotError(f"I/O error while {action} in snapshot directory {directory}: {exc}")
