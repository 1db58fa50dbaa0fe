"""The one wait helper: poll a condition with exponential backoff until it holds or a deadline
passes (shared-memory words and processes: a library's retry-on-exception model does not fit).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(ready: Callable[[], bool], *, timeout_s: float | None, first_s: float = 1e-3, max_s: float = 0.05,
               sleep: Callable[[float], object] = time.sleep) -> bool:
    """Call ``ready()`` (at once, and once more at the deadline) until it returns true: True
    then, False once ``timeout_s`` (None: no limit) passed. Sleeps ``first_s``, doubling up to
    ``max_s``; ``sleep`` may raise to abort the wait (a cancelled snapshot)."""
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
