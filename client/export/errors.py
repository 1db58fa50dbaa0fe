"""The export's own error, apart from the modules that raise it (the snapshot export and the
download from the store import it both ways: one home, no import cycle)."""

from __future__ import annotations

from swap_state.common.snapshot_errors import SnapshotError

__all__ = ["ExportError"]


class ExportError(SnapshotError):
    """The snapshot cannot be exported: it cannot be expressed as a flat state dict (e.g.
    shards leave holes), or the store or a flag stands in the way; the message says which."""
