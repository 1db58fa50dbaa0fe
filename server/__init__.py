"""swap-state-server: the per-host state server. Never imports torch."""
