"""Committing snapshots to the tiers: the local directory and the store upload."""
