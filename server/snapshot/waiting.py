"""Waits that event-loop code shares with threads, holding no thread while it waits.

A snapshot's Snapshot and SnapshotStatus RPCs wait for the other ranks of their group, for the
writer to let go of a segment, for an upload: up to minutes, and one per rank. A wait in
``asyncio.to_thread`` holds one of the default executor's few threads (min(32, CPUs + 4)) for
all that time, and a host whose waiting ranks outnumber them stops serving: the next rank's
Snapshot cannot get a thread to start the snapshot they all wait for.

:class:`WatchedCondition` is a ``threading.Condition`` whose ``notify_all`` also wakes coroutines
awaiting :meth:`WatchedCondition.until`; :class:`Latch` is a ``threading.Event`` built on it.
The threads that change the state (writers, the uploader) keep calling ``notify_all`` under the
lock as before; the loop's side checks its predicate under the same lock, briefly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

__all__ = ["WatchedCondition", "Latch"]


class _Watcher:
    """A coroutine's predicate and the future that wakes it, resolved on its own loop."""

    def __init__(self, predicate: Callable[[], bool], loop: asyncio.AbstractEventLoop) -> None:
        self.predicate = predicate
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._resolve)
        except RuntimeError:  # the loop is closed (server shutdown): nobody waits any more
            pass

    def _resolve(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class WatchedCondition:
    """A ``threading.Condition`` (``with``, ``wait``, ``wait_for``, ``notify_all``) that
    coroutines can await (:meth:`until`) without holding a thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watchers: list[_Watcher] = []

    def __enter__(self) -> bool:
        return self._cond.__enter__()

    def __exit__(self, *exc_info) -> None:
        self._cond.__exit__(*exc_info)

    def wait(self, timeout: float | None = None) -> bool:
        return self._cond.wait(timeout)

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        return self._cond.wait_for(predicate, timeout)

    def notify_all(self) -> None:
        """Wake the waiting threads, and the coroutines whose predicate holds now. The caller
        holds the lock (as for ``threading.Condition.notify_all``)."""
        self._cond.notify_all()
        if self._watchers:
            waiting = []
            for watcher in self._watchers:
                if watcher.predicate():
                    watcher.wake()
                else:
                    waiting.append(watcher)
            self._watchers = waiting

    async def until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Await ``predicate()`` (checked under the lock, now and at each ``notify_all``), at
        most ``timeout`` seconds (None: no limit). True once it holds, False on timeout."""
        watcher = _Watcher(predicate, asyncio.get_running_loop())
        with self._cond:
            if predicate():
                return True
            self._watchers.append(watcher)
        try:
            await asyncio.wait_for(watcher.future, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            with self._cond:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)


class Latch:
    """A ``threading.Event`` (``set``, ``is_set``, ``wait``) that coroutines can await too
    (:meth:`wait_async`), holding no thread."""

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
