"""Domain errors of snapshots and restore.

Every error derives from :class:`SnapshotError` and from the matching base class of
:mod:`swap_state.server.errors`, so the servicer's one mapping to gRPC codes covers them; the
``grpc_code`` class attribute names the intended code explicitly (as the name of a
``grpc.StatusCode`` member) for the one case that base classes do not cover (DATA_LOSS).
This module imports neither grpc nor torch.
"""

from __future__ import annotations

import errno

from .errors import DomainError, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

__all__ = [
    "SnapshotError",
    "SnapshotInvalid",
    "SnapshotNotFound",
    "SnapshotBusy",
    "SnapshotExists",
    "SnapshotFailed",
    "SnapshotCorrupt",
    "SnapshotLayoutMismatch",
    "SnapshotDiskFull",
    "from_os_error",
]


class SnapshotError(DomainError):
    """Base of every snapshot/restore error; also used for I/O failures without a better class."""

    grpc_code = "INTERNAL"


class SnapshotInvalid(SnapshotError, InvalidArgument):
    """A malformed request: job id, snapshot id, metadata_json, rank/world size."""

    grpc_code = "INVALID_ARGUMENT"


class SnapshotNotFound(SnapshotError, NotFound):
    """No complete snapshot (or no in-memory snapshot record) under that id."""

    grpc_code = "NOT_FOUND"


class SnapshotBusy(SnapshotError, FailedPrecondition):
    """The segment cannot be snapshotted or restored now (a snapshot of it is persisting,
    the trainer is writing a step, or a failed attempt is still being cleaned up)."""

    grpc_code = "FAILED_PRECONDITION"


class SnapshotExists(SnapshotError, FailedPrecondition):
    """A complete snapshot of that job and step is already on disk."""

    grpc_code = "FAILED_PRECONDITION"


class SnapshotFailed(SnapshotError, FailedPrecondition):
    """The snapshot this rank tries to join has already failed (another rank's error)."""

    grpc_code = "FAILED_PRECONDITION"


class SnapshotCorrupt(SnapshotError):
    """A snapshot file does not verify (checksum, size, header); the message names the file
    and, where it applies, the tensor."""

    grpc_code = "DATA_LOSS"


class SnapshotLayoutMismatch(SnapshotError, FailedPrecondition):
    """The snapshot does not fit the target: other world size, tensor names, dtypes or shapes."""

    grpc_code = "FAILED_PRECONDITION"


class SnapshotDiskFull(SnapshotError, ResourceExhausted):
    """The snapshot directory ran out of space (ENOSPC/EDQUOT); the message names the directory."""

    grpc_code = "RESOURCE_EXHAUSTED"


def from_os_error(exc: OSError, action: str, directory: object) -> SnapshotError:
    """The domain error for an I/O failure while ``action`` (e.g. "writing rank-00000.safetensors")
    under the snapshot directory ``directory``: disk full and quota become SnapshotDiskFull,
    with a message that names the directory and says what to do."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SnapshotDiskFull(
            f"snapshot directory {directory} is full ({exc.strerror}) while {action}; "
            "the snapshot was discarded and training is unaffected: free space, "
            "lower --keep-latest or point --snapshot-dir at a larger volume"
        )
    return SnapshotError(f"I/O error while {action} in snapshot directory {directory}: {exc}")
