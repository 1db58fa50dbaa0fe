"""Domain errors of snapshots and restore, each with its ``code`` and ``reason`` like
:mod:`.errors`."""

from __future__ import annotations

import errno

from .errors import SwapStateError

__all__ = [
    "SnapshotError", "SnapshotInvalid", "SnapshotNotFound", "SnapshotBusy", "SnapshotExists",
    "SnapshotFailed", "SnapshotCorrupt", "SnapshotLayoutMismatch", "SnapshotDiskFull",
    "SnapshotStoreUnavailable", "from_os_error"
]


class SnapshotError(SwapStateError):
    """Base of every snapshot/restore error; also used for I/O failures without a better class."""

    code = "INTERNAL"
    reason = "SNAPSHOT_ERROR"


class SnapshotInvalid(SnapshotError):
    """A malformed request: job id, snapshot id, metadata_json, rank/world size."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"


class SnapshotNotFound(SnapshotError):
    """No complete snapshot (or no in-memory snapshot record) under that id."""

    code = "NOT_FOUND"
    reason = "SNAPSHOT_NOT_FOUND"


class SnapshotBusy(SnapshotError):
    """The segment cannot be snapshotted or restored now (persisting, mid-step, cleaning up)."""

    code = "FAILED_PRECONDITION"
    reason = "SNAPSHOT_BUSY"


class SnapshotExists(SnapshotError):
    """A complete snapshot of that job and step is already on disk."""

    code = "FAILED_PRECONDITION"
    reason = "SNAPSHOT_EXISTS"


class SnapshotFailed(SnapshotError):
    """The snapshot this rank tries to join has already failed (another rank's error)."""

    code = "FAILED_PRECONDITION"
    reason = "SNAPSHOT_FAILED"


class SnapshotCorrupt(SnapshotError):
    """A snapshot file does not verify (checksum, size, header); the message names file and tensor."""

    code = "DATA_LOSS"
    reason = "SNAPSHOT_CORRUPT"


class SnapshotLayoutMismatch(SnapshotError):
    """The snapshot does not fit the target: other world size, tensor names, dtypes or shapes."""

    code = "FAILED_PRECONDITION"
    reason = "LAYOUT_MISMATCH"


class SnapshotDiskFull(SnapshotError):
    """The snapshot directory ran out of space (ENOSPC/EDQUOT); the message names the directory."""

    code = "RESOURCE_EXHAUSTED"
    reason = "DISK_FULL"


class SnapshotStoreUnavailable(SnapshotError):
    """The snapshot store failed a request (unreachable, refusing, timed out); names the object."""

    code = "UNAVAILABLE"
    reason = "STORE_UNAVAILABLE"


def from_os_error(exc: OSError, action: str, directory: object) -> SnapshotError:
    """The domain error for an I/O failure while ``action`` in ``directory``: disk full and
    quota become SnapshotDiskFull, saying what to do."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SnapshotDiskFull(
            f"snapshot directory {directory} is full ({exc.strerror}) while {action}; "
            "the snapshot was discarded and training is unaffected: free space, "
            "lower --keep-latest or point --snapshot-dir at a larger volume"
        )
    return SnapshotError(f"I/O error while {action} in snapshot directory {directory}: {exc}")
