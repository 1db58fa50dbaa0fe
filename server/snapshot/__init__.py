"""Snapshots: the coordinator and its groups of ranks, the rank writers and their stager, what
a rank's files hold (plan) apart from where they go (storage), the ``--snapshot-dir``'s commit
sequence and retention (directory), the store's upload, and restore from either tier."""

__all__: list[str] = []
