"""Snapshots: the coordinator and its groups of ranks, the rank writers (what a rank's files
hold) and their stager, where the files go (storage), the ``--snapshot-dir``'s commit
sequence and retention (directory), the store's upload, and restore from either tier."""

__all__: list[str] = []
