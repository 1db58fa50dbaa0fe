"""Waits that event-loop code shares with threads, holding no thread while it waits.

The Snapshot and SnapshotStatus RPCs wait for a group's other ranks, a segment's release, an
upload: up to minutes, one per rank. In ``asyncio.to_thread`` each would hold one of the
default executor's few threads, and a host whose waiting ranks outnumber them stops serving.
:class:`WatchedCondition` is a ``threading.Condition`` whose ``notify_all`` also wakes awaiting
coroutines; :class:`Latch` is a ``threading.Event`` built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

__all__ = ["WatchedCondition", "Latch"]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class WatchedCondition:
    """A ``threading.Condition`` that coroutines can await (:meth:`until`) without holding a thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watchers: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []  # each on its loop

    def __enter__(self) -> bool:
        return self._cond.__enter__()

    def __exit__(self, *exc_info) -> None:
        self._cond.__exit__(*exc_info)

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        return self._cond.wait_for(predicate, timeout)

    def notify_all(self) -> None:
        """Wake the waiting threads, and the coroutines whose predicate holds now (under the lock)."""
        self._cond.notify_all()
        waiting = []
        for predicate, future in self._watchers:
            if not predicate():
                waiting.append((predicate, future))
            else:
                with contextlib.suppress(RuntimeError):  # the loop is closed (shutdown): nobody waits
                    future.get_loop().call_soon_threadsafe(_resolve, future)
        self._watchers = waiting

    async def until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Await ``predicate()`` (checked under the lock at each ``notify_all``), at most
        ``timeout`` seconds (None: no limit); False on timeout."""
        watcher = (predicate, asyncio.get_running_loop().create_future())
        with self._cond:
            if predicate():
                return True
            self._watchers.append(watcher)
        try:
            await asyncio.wait_for(watcher[1], timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            with self._cond:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)


class Latch:
    """A ``threading.Event`` that coroutines can await too (:meth:`wait_async`), holding no thread."""

    def __init__(self) -> None:
        self._cond = WatchedCondition()
        self._set = False

    def set(self) -> None:
        with self._cond:
            self._set = True
            self._cond.notify_all()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(self.is_set, timeout)

    async def wait_async(self, timeout: float | None = None) -> bool:
        return await self._cond.until(self.is_set, timeout)
