"""Offline export of snapshots: plain torch and DCP files (:mod:`.snapshot`), torchtitan
checkpoints (:mod:`.torchtitan`), and the ``swap-state export`` command line (:mod:`.cli`,
also ``python -m swap_state.client.export``). Names are imported lazily: the admin CLI's
import of :mod:`.cli` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportResult",
    "SnapshotState",
    "export_snapshot",
    "export_torchtitan_checkpoint",
    "load_flat_state_dict",
    "main",
    "read_snapshot_state",
    "run_export",
]

_LAZY = {
    "main": "swap_state.client.export.cli",
    "run_export": "swap_state.client.export.cli",
    "export_torchtitan_checkpoint": "swap_state.client.export.torchtitan",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'swap_state.client.export' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY.get(name, "swap_state.client.export.snapshot")), name)
