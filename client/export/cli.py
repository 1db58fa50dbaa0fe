"""``python -m swap_state.client.export``: the same as ``swap-state export``
(:mod:`swap_state.client.cli`, which owns its arguments and its run)."""

from __future__ import annotations

import sys

from swap_state.client.cli import main as cli_main
from swap_state.client.cli import run_export

__all__ = ["main", "run_export"]


def main(argv: list[str] | None = None) -> int:
    """``swap-state export SNAPSHOT OUT [--format torch|dcp|torchtitan] [--snapshot-dir DIR |
    --snapshot-store URI]``."""
    return cli_main(["export", *(sys.argv[1:] if argv is None else argv)])
