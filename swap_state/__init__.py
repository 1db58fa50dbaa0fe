"""swap-state: an out-of-process optimizer-state server for PyTorch training.

Subpackages: ``swap_state.proto`` (the wire protocol), ``swap_state.common`` (the contracts
both sides rely on: the shared-memory segment layout and its header words, the snapshot
format), ``swap_state.server`` (the torch-free state server), ``swap_state.client`` (the
trainer side).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
