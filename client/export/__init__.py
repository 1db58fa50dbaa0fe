"""Offline export of snapshots: plain torch and DCP files (:mod:`.snapshot`), torchtitan checkpoints
(:mod:`.torchtitan`); ``python -m swap_state.client.export`` is ``swap-state export``."""
