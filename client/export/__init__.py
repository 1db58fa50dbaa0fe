"""Offline export of snapshots: plain torch and DCP files (:mod:`.snapshot`), torchtitan
checkpoints (:mod:`.torchtitan`); ``python -m swap_state.client.export`` is ``swap-state
export``."""

from swap_state.client.export.snapshot import (
    FORMATS,
    ExportError,
    ExportResult,
    SnapshotState,
    export_snapshot,
    load_flat_state_dict,
    read_snapshot_state,
)
from swap_state.client.export.torchtitan import export_torchtitan_checkpoint

__all__ = [
    "FORMATS", "ExportError", "ExportResult", "SnapshotState", "export_snapshot",
    "export_torchtitan_checkpoint", "load_flat_state_dict", "read_snapshot_state",
]
