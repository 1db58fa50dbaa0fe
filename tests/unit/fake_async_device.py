"""A fake asynchronous accelerator for CPU tests: work on side streams completes later.

:class:`AsyncFakeBackend` is a :class:`~swap_state.client.device.DeviceBackend` whose "device"
tensors are CPU tensors, but whose side streams behave like a slow real device:

- Inside ``use_stream(side)`` a dispatch mode queues every ``copy_`` on that stream instead of
  running it, and counts each tensor allocated there (``empty`` / ``empty_like``) as device
  memory. Nothing queued runs until the host waits for it: ``event.synchronize()``,
  ``stream.synchronize()``, ``backend.synchronize()``, or a wait of the (eager) compute stream.
  This is the slowest device possible, so it shows the most memory any device speed can hold.
- The compute stream runs at once (kernels on it are ordinary CPU ops); its
  ``wait_event(e)`` therefore runs ``e``'s stream up to ``e`` first. A side stream's
  ``wait_event(e)`` is queued: running it runs ``e``'s stream up to ``e``.
- Device memory is released as the caching allocator does it: a tensor freed while a stream
  it was recorded on (``record_stream``) still has work queued from before the free stays
  held until that stream has run that work.

``live_bytes`` / ``peak_bytes`` count device bytes; ``pending()`` is the number of queued,
unrun items over all streams. ``set_device_calls`` and ``event_kwargs`` record the hooks the
code under test called. ``accelerator=True`` makes ``is_accelerator`` true (code paths that
only run on an accelerator); the pipelined step wants the default False, because on an
accelerator it skips ``record_stream`` for CPU tensors (its CPU step copies).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swap_state.client.device import DeviceBackend

__all__ = ["AsyncFakeBackend", "FakeEvent", "FakeStream"]

_ALLOCATIONS = (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format)


class FakeStream:
    """A queue of work; the compute stream (``eager``) runs each item when it is queued."""

    def __init__(self, backend: AsyncFakeBackend, name: str, *, eager: bool = False) -> None:
        self.backend, self.name, self.eager = backend, name, eager
        self.enqueued = 0  # items ever queued; the position an event records
        self.completed = 0  # items run so far
        self._queue: list[Callable[[], Any]] = []

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r}, pending={self.enqueued - self.completed})"

    def enqueue(self, work: Callable[[], Any]) -> None:
        with self.backend.lock:
            self._queue.append(work)
            self.enqueued += 1
        if self.eager:
            self.run_until(self.enqueued)

    def run_until(self, mark: int) -> None:
        """Run the queued items up to position ``mark`` (in order)."""
        with self.backend.lock:
            while self.completed < mark:
                work = self._queue.pop(0)
                work()
                self.completed += 1
                del work  # its tensors may be freed now (after it counts as run), not later
            self.backend.release_completed()

    def wait_event(self, event: FakeEvent) -> None:
        self.enqueue(event.synchronize)

    def wait_stream(self, stream: FakeStream) -> None:
        self.enqueue(functools.partial(stream.run_until, stream.enqueued))

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or self.backend.event()
        event.record(self)
        return event

    def query(self) -> bool:
        return self.completed == self.enqueued

    def synchronize(self) -> None:
        self.run_until(self.enqueued)


class FakeEvent:
    """A position in one stream's queue."""

    def __init__(self, backend: AsyncFakeBackend) -> None:
        self.backend = backend
        self.stream: FakeStream | None = None
        self.mark = 0

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or self.backend.current_stream()
        self.mark = self.stream.enqueued

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.backend.current_stream()).wait_event(self)

    def query(self) -> bool:
        return self.stream is None or self.stream.completed >= self.mark

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.mark)


class _SideStreamMode(TorchDispatchMode):
    """Active while a side stream is current: copies are queued on it, allocations counted."""

    def __init__(self, stream: FakeStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            self.stream.enqueue(functools.partial(func, *args, **kwargs))
            return args[0]
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self.stream.backend.allocated(out)
        return out


class AsyncFakeBackend(DeviceBackend):
    """A CPU backend that behaves like the slowest asynchronous accelerator (module doc)."""

    def __init__(self, *, accelerator: bool = False) -> None:
        super().__init__("cpu")
        self.lock = threading.RLock()
        self._accelerator = accelerator
        self.compute = FakeStream(self, "compute", eager=True)
        self.streams: list[FakeStream] = [self.compute]
        self._current = threading.local()
        self._tokens = itertools.count()
        self._live: dict[int, int] = {}  # token -> bytes, allocated and not yet released
        self._recorded: dict[int, set[FakeStream]] = {}
        self._held: list[tuple[int, list[tuple[FakeStream, int]]]] = []  # freed, pinned by streams
        self.live_bytes = 0
        self.peak_bytes = 0
        self.set_device_calls: list[tuple[str, torch.device]] = []
        self.event_kwargs: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"AsyncFakeBackend(accelerator={self._accelerator}, streams={self.streams})"

    @property
    def is_accelerator(self) -> bool:
        return self._accelerator

    def current_device(self) -> torch.device:
        return torch.device("cpu")  # its "device" tensors are CPU tensors

    def set_device(self, device: torch.device) -> None:
        self.set_device_calls.append((threading.current_thread().name, device))

    def stream(self) -> FakeStream:
        stream = FakeStream(self, f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return getattr(self._current, "stream", self.compute)

    def event(self, *, blocking: bool = False) -> FakeEvent:
        self.event_kwargs.append({"blocking": blocking})
        return FakeEvent(self)

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[Any]:
        previous = self.current_stream()
        self._current.stream = stream
        try:
            with contextlib.ExitStack() as modes:
                if not stream.eager:
                    modes.enter_context(_SideStreamMode(stream))
                yield stream
        finally:
            self._current.stream = previous

    def synchronize(self) -> None:
        for stream in list(self.streams):
            stream.synchronize()

    def pending(self) -> int:
        """Queued items not yet run, over all streams."""
        return sum(stream.enqueued - stream.completed for stream in self.streams)

    # -- device memory --------------------------------------------------------------------
    def allocated(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as device memory until it is freed and no stream pins it."""
        token = next(self._tokens)
        with self.lock:
            self.release_completed()
            self._live[token] = tensor.untyped_storage().nbytes()
            self._recorded[token] = set()
            self.live_bytes += self._live[token]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        tensor._fake_device_token = token  # type: ignore[attr-defined]
        weakref.finalize(tensor, self._freed, token)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        token = getattr(tensor, "_fake_device_token", None)
        if token is not None:
            with self.lock:
                self._recorded[token].add(stream)

    def _freed(self, token: int) -> None:
        # As the caching allocator: the memory is reusable once every recorded stream has
        # run what was queued on it when the tensor was freed.
        with self.lock:
            pins = [(stream, stream.enqueued) for stream in self._recorded.pop(token)]
            self._held.append((token, pins))
            self.release_completed()

    def release_completed(self) -> None:
        with self.lock:
            still_held = []
            for token, pins in self._held:
                if all(stream.completed >= mark for stream, mark in pins):
                    self.live_bytes -= self._live.pop(token)
                else:
                    still_held.append((token, pins))
            self._held = still_held
