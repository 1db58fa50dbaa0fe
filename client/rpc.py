"""The programmatic admin client under its public name (``SwapStateClient``, ``ClientConfig``);
it lives in :mod:`swap_state.client.remote.rpc`. Importing it does not import torch."""

from swap_state.client.remote.rpc import (
    ClientConfig, RemoteSession, ServerUnavailableError, SessionLostError, SwapStateClient,
    SwapStateError, normalize_target)

__all__ = [
    "ClientConfig", "SwapStateError", "ServerUnavailableError", "SessionLostError", "SwapStateClient",
    "RemoteSession", "normalize_target"]
