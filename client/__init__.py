"""swap-state trainer side: device layer, swap optimizers, the remote container."""
