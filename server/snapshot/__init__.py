"""Snapshots: the coordinator and its groups of ranks; writing (a rank's writer, its copy-ahead, sink and files), tiers
(the ``--snapshot-dir`` directory and the store's upload) and restoring (the tier to read, the plan and the reads)."""

__all__: list[str] = []
