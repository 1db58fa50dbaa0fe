"""Domain errors of snapshots and restore, each with its ``code`` and ``reason`` like :mod:`.errors`."""

from __future__ import annotations

import errno

from .errors import SwapStateError

__all__ = [
    "SnapshotError", "SnapshotInvalid", "SnapshotNotFoundError", "SnapshotBusyError", "SnapshotExistsError",
    "SnapshotFailedError", "SnapshotCorruptError", "SnapshotLayoutMismatch", "DiskFullError",
    "StoreUnavailableError", "from_os_error"]


class SnapshotError(SwapStateError, code="INTERNAL", reason="SNAPSHOT_ERROR"):
    """Base of every snapshot/restore error; also used for I/O failures without a better class."""


class SnapshotInvalid(SnapshotError, code="INVALID_ARGUMENT", reason="INVALID_ARGUMENT"):
    """A malformed request: job id, snapshot id, metadata_json, rank/world size."""


class SnapshotNotFoundError(SnapshotError, code="NOT_FOUND", reason="SNAPSHOT_NOT_FOUND"):
    """No complete snapshot (or no in-memory snapshot record) under that id."""


class SnapshotBusyError(SnapshotError, code="FAILED_PRECONDITION", reason="SNAPSHOT_BUSY"):
    """The segment cannot be snapshotted or restored now (persisting, mid-step, cleaning up)."""


class SnapshotExistsError(SnapshotError, code="FAILED_PRECONDITION", reason="SNAPSHOT_EXISTS"):
    """A complete snapshot of that job and step is already on disk."""


class SnapshotFailedError(SnapshotError, code="FAILED_PRECONDITION", reason="SNAPSHOT_FAILED"):
    """The snapshot this rank tries to join has already failed (another rank's error)."""


class SnapshotCorruptError(SnapshotError, code="DATA_LOSS", reason="SNAPSHOT_CORRUPT"):
    """A snapshot file does not verify (checksum, size, header); the message names file and tensor."""


class SnapshotLayoutMismatch(SnapshotError, code="FAILED_PRECONDITION", reason="LAYOUT_MISMATCH"):
    """The snapshot does not fit the target: other world size, tensor names, dtypes or shapes."""


class DiskFullError(SnapshotError, code="RESOURCE_EXHAUSTED", reason="DISK_FULL"):
    """The snapshot directory ran out of space (ENOSPC/EDQUOT); the message names the directory."""


class StoreUnavailableError(SnapshotError, code="UNAVAILABLE", reason="STORE_UNAVAILABLE"):
    """The snapshot store failed a request (unreachable, refusing, timed out); names the object."""


def from_os_error(exc: OSError, action: str, directory: object) -> SnapshotError:
    """The domain error for an I/O failure while ``action`` in ``directory``: disk full and
    quota become DiskFullError, saying what to do."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"snapshot directory {directory} is full ({exc.strerror}) while {action}; "
                                "the snapshot was discarded and training is unaffected: free space, "
                                "lower --keep-latest or point --snapshot-dir at a larger volume")
    return SnapshotError(f"I/O error while {action} in snapshot directory {directory}: {exc}")
