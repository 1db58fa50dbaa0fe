"""Outcomes of the RPCs: calls per (method, status code) and seconds per method, counted by
the RPC boundary (:func:`swap_state.server.rpc.statuses.rpc_boundary`), read by the metrics."""

from __future__ import annotations

import grpc

__all__ = ["RpcCounters"]


class RpcCounters:
    """Calls per (method, status code) and their total seconds, for the metrics endpoint."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], int] = {}
        self.seconds: dict[str, float] = {}

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        key = (method, code.name)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.seconds[method] = self.seconds.get(method, 0.0) + seconds
