"""Snapshots: coordinator, writer and stager, the on-disk store and restore."""
