"""The one wait-and-retry helper: poll a condition with exponential backoff until it holds or a
deadline passes. Hand-written because the loops it serves poll shared-memory words and
processes, where a library's retry-on-exception model does not fit and a few lines do.

Every wait of the project that polls (a free copy slot, the segment's release, the trainer's
model copy, a starting server) goes through :func:`wait_until`, so each has a deadline and
backs off the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(
    ready: Callable[[], bool],
    *,
    timeout_s: float | None,
    first_s: float = 1e-3,
    max_s: float = 0.05,
    sleep: Callable[[float], object] = time.sleep,
) -> bool:
    """Call ``ready()`` until it returns true: True then, False once ``timeout_s`` (None: no
    limit) has passed first. Between calls it sleeps ``first_s``, doubling up to ``max_s``.

    ``ready`` is called at once (no sleep when the condition already holds) and once more at
    the deadline. ``sleep(seconds)`` may be an ``Event.wait`` wrapper that raises to abort
    the wait (a cancelled snapshot, say).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = first_s
    while not ready():
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            pause = min(pause, left)
        sleep(pause)
        pause = min(pause * 2, max_s)
    return True
