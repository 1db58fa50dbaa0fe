"""Snapshots: the coordinator and its groups of ranks, the rank writers and their stager, what
a rank's files hold (plan) apart from where they go (the storage seam: storage, local_storage),
the commit sequence and retention (store), and restore."""

__all__: list[str] = []
