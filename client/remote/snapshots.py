"""A handle on a snapshot in progress: wait until it is durable, or in the store."""

from __future__ import annotations

import dataclasses
import time

from swap_state.client.errors import SnapshotFailedError, SwapStateError
from swap_state.client.remote.rpc import SwapStateClient

__all__ = ["SnapshotHandle"]


@dataclasses.dataclass
class SnapshotHandle:
    """A snapshot in progress (``c.snapshot()`` returns once it is consistent)."""

    snapshot_id: str
    step: int
    rank: int
    client: SwapStateClient

    def status(self, wait_s: float = 0.0, wait_stored: bool = False):
        return self.client.snapshot_status(self.snapshot_id, self.rank, wait_s, wait_stored)

    def wait_durable(self, timeout_s: float = 600.0):
        """The status once durable (or stored); SnapshotFailedError if it failed, TimeoutError."""
        return self._wait(timeout_s, stored=False)

    def wait_stored(self, timeout_s: float = 600.0):
        """The status once this rank's files are in the ``--snapshot-store``; SwapStateError
        when the upload failed or there is no store; TimeoutError."""
        return self._wait(timeout_s, stored=True)

    def _wait(self, timeout_s: float, stored: bool):
        deadline = time.monotonic() + timeout_s
        goal = ("stored",) if stored else ("durable", "stored")
        while True:
            remaining = deadline - time.monotonic()
            reply = self.status(wait_s=max(0.0, min(remaining, 5.0)), wait_stored=stored)
            if reply.state in goal:
                return reply
            if reply.state == "failed":
                raise SnapshotFailedError(f"snapshot {self.snapshot_id} failed: {reply.error}")
            if stored and reply.state == "durable" and reply.store_state in ("", "failed"):
                why = reply.store_error or "the server has no --snapshot-store"
                raise SwapStateError(f"snapshot {self.snapshot_id} is durable but not stored: {why}")
            if remaining <= 0:
                what = "stored" if stored else "durable"
                done = reply.bytes_stored if stored else reply.bytes_persisted
                raise TimeoutError(f"snapshot {self.snapshot_id} not {what} after {timeout_s}s "
                                   f"({done}/{reply.bytes_total} bytes)")
