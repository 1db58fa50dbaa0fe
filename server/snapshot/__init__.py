"""Snapshots: the coordinator and its groups of ranks, the rank writers (what a rank's files
hold) and their stager, the ``--snapshot-dir`` (where the files go, the commit sequence and
retention: directory), the store's upload, and restore from either tier."""

__all__: list[str] = []
