"""Restoring: the tier to read, the plan (layout index, resharding) and the reads."""
