"""The server-wide cap on snapshot I/O (``--persist-max-bandwidth``): :class:`BandwidthLimiter`,
one per coordinator, shared by its rank writers (and one by the uploader).
"""

from __future__ import annotations

import threading
import time

__all__ = ["BandwidthLimiter"]


class BandwidthLimiter:
    """A shared cap in bytes/s (None: no cap): every writer reserves its next chunk's bytes on
    one virtual timeline, so the cap holds for the whole server. Thread-safe."""

    def __init__(self, bytes_per_second: float | None):
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be > 0 (or None for no cap)")
        self.bytes_per_second = bytes_per_second
        self._lock = threading.Lock()
        self._next_free = 0.0  # monotonic time at which the timeline is free again

    def acquire(self, nbytes: int, cancel: threading.Event) -> bool:
        """Block until ``nbytes`` may move; False when ``cancel`` was set meanwhile."""
        if self.bytes_per_second is None:
            return not cancel.is_set()
        with self._lock:
            now = time.monotonic()
            start = max(self._next_free, now)
            self._next_free = start + nbytes / self.bytes_per_second
        if start > now:
            return not cancel.wait(start - now)
        return not cancel.is_set()
