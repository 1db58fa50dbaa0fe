"""The Ascend registration probe and the pinned bounce ring, on CPU with the fake
asynchronous device (:mod:`fake_async_device`): the probe's decision, its measurement on a
runtime that synchronizes after copies from registered memory, the one WARNING, and copies
staged through the ring that stay correct however late the device runs them."""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fake_async_device import AsyncFakeBackend, FakeEvent, FakeStream
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from swap_state.client import device, host_register
from swap_state.client.host_register import (
    PAGE_SIZE,
    BounceRing,
    CopyProbe,
    ProbeConfig,
    copies_are_async,
    npu_versions,
    probe_registered_copies,
)

SMALL_PROBE = ProbeConfig(nbytes=16 << 10, busy_side=8, busy_matmuls=1)


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        (CopyProbe(True, 1e-5, True, 1e-5), True),  # returned before the copy was done
        (CopyProbe(True, 9e-3, False, 1e-5), True),  # slow call, but it did not wait
        (CopyProbe(False, 2e-5, True, 1e-5), False),  # pinned was in flight, registered not
        (CopyProbe(False, 2e-4, False, 1e-4), True),  # device outran both: same call times
        (CopyProbe(False, 9e-4, False, 1e-4), True),  # 9x, but within the 1 ms margin
        (CopyProbe(False, 5e-3, False, 1e-4), False),  # the call lasted as long as the work
        (CopyProbe(False, 5e-2, False, 1e-2), False),  # 5x of a long call
    ],
)
def test_probe_decision(probe: CopyProbe, expected: bool) -> None:
    assert copies_are_async(probe) is expected


class _Stream(FakeStream):
    """The fake's stream, running its queued work outside the host's dispatch modes as a
    device does: a wait inside ``use_stream`` (the ring's, the probe's) must run the queued
    copies, not queue them again."""

    def run_until(self, mark: int) -> None:
        with _disable_current_modes():
            super().run_until(mark)


def _stream(backend: AsyncFakeBackend) -> _Stream:
    stream = _Stream(backend, f"side{len(backend.streams)}")
    backend.streams.append(stream)
    return stream


class _SyncAfterRegisteredCopy(TorchDispatchMode):
    """Older torch_npu: a copy from host memory it did not allocate waits for the stream."""

    def __init__(self, backend: SyncingBackend, stream: FakeStream) -> None:
        super().__init__()
        self.backend, self.stream = backend, stream

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))  # queued on the stream by the fake's own mode
        if func is torch.ops.aten.copy_.default and self.backend.registered(args[1]):
            self.stream.synchronize()
        return out


class SyncingBackend(AsyncFakeBackend):
    """The fake asynchronous device, probed as Ascend is; with ``synchronizing``, copies from
    registered memory return only once the stream has run them. Its allocations claim to be
    pinned (the accelerator paths), without pinning."""

    probes_registered_copies = True

    def __init__(self, *, synchronizing: bool) -> None:
        super().__init__()
        self.synchronizing = synchronizing
        self.copy_probe = SMALL_PROBE

    @property
    def pin_memory_available(self) -> bool:
        return True

    def alloc_host(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype)

    def stream(self) -> _Stream:
        return _stream(self)

    def registered(self, tensor: Any) -> bool:
        ptr = tensor.data_ptr() if isinstance(tensor, torch.Tensor) else -1
        return any(r.ptr <= ptr < r.ptr + r.nbytes for r in self.registered_ranges())

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[Any]:
        with super().use_stream(stream), contextlib.ExitStack() as modes:
            if self.synchronizing and not stream.eager:
                modes.enter_context(_SyncAfterRegisteredCopy(self, stream))
            yield stream


@pytest.fixture
def region() -> Iterator[tuple[mmap.mmap, int]]:
    mapped = mmap.mmap(-1, 4 * PAGE_SIZE)
    tensor = torch.frombuffer(mapped, dtype=torch.uint8)
    tensor.copy_(torch.arange(tensor.numel()) % 251)
    yield mapped, tensor.data_ptr()
    del tensor
    mapped.close()


@pytest.fixture
def one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_register, "_WARNED_SYNCHRONOUS", False)


@pytest.mark.parametrize("synchronizing", [False, True])
def test_probe_measures_what_the_runtime_does(synchronizing: bool, region: Any) -> None:
    backend = SyncingBackend(synchronizing=synchronizing)
    backend.probes_registered_copies = False  # measure by hand
    registration = backend.register_host_memory(region[1], 4 * PAGE_SIZE)
    probe = probe_registered_copies(backend, registration.ptr, registration.nbytes, SMALL_PROBE)
    assert probe.pinned_pending and probe.registered_pending is not synchronizing
    assert copies_are_async(probe) is not synchronizing
    assert backend.pending() == 0  # the probe leaves nothing in flight


@pytest.mark.usefixtures("one_warning")
def test_synchronous_registration_bounces_with_one_warning(
    region: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = SyncingBackend(synchronizing=True)
    second = mmap.mmap(-1, PAGE_SIZE)
    second_ptr = torch.frombuffer(second, dtype=torch.uint8).data_ptr()
    with caplog.at_level(logging.WARNING, logger="swap_state.client"):
        backend.register_host_memory(region[1], 4 * PAGE_SIZE)
        backend.register_host_memory(second_ptr, PAGE_SIZE)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bounce buffers" in warnings[0].getMessage()
    assert "torch" in warnings[0].getMessage()  # the versions (CANN / torch_npu on Ascend)
    host = torch.frombuffer(region[0], dtype=torch.uint8)
    assert backend.bounces(host[100:]) and backend.bounces(torch.frombuffer(second, dtype=torch.uint8))
    assert not backend.bounces(torch.zeros(4))
    backend.unregister_host_memory(region[1])
    assert not backend.bounces(host)
    backend.unregister_host_memory(second_ptr)
    del host


@pytest.mark.usefixtures("one_warning")
def test_asynchronous_registration_copies_directly(region: Any, caplog: pytest.LogCaptureFixture) -> None:
    backend = SyncingBackend(synchronizing=False)
    with caplog.at_level(logging.WARNING):
        backend.register_host_memory(region[1], 4 * PAGE_SIZE)
    assert not caplog.records and not backend.bounces(torch.frombuffer(region[0], dtype=torch.uint8))
    backend.unregister_host_memory(region[1])


@pytest.mark.usefixtures("one_warning")
def test_backend_copies_go_through_the_ring_both_ways(region: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "BOUNCE_SLOT_BYTES", 1000)
    backend = SyncingBackend(synchronizing=True)
    backend.register_host_memory(region[1], 4 * PAGE_SIZE)
    host = torch.frombuffer(region[0], dtype=torch.uint8)
    moment = host[512 : 512 + 4096].view(torch.float32)  # a moment in the segment
    expected = moment.clone()
    side = backend.stream()
    with backend.use_stream(side):
        on_device = torch.empty_like(moment)
        backend.copy_to_device(on_device, moment)
        ring = backend.bounce_ring()
        assert ring.pieces == 5  # 4096 bytes in 1000-byte slots
        plain = torch.empty(3)
        backend.copy_to_device(plain, torch.ones(3))  # not registered: a direct copy
        assert ring.pieces == 5
    side.synchronize()
    assert torch.equal(on_device, expected) and torch.equal(plain, torch.ones(3))
    moment.zero_()
    with backend.use_stream(side):
        backend.copy_to_host(moment, on_device * 2)
        done = backend.event()
        done.record(side)
    done.synchronize()
    assert torch.equal(moment, expected * 2) and ring.pieces == 10
    del host, moment
    backend.unregister_host_memory(region[1])


class _DeviceCopiesQueued(TorchDispatchMode):
    """A copy that touches ``device`` is queued on ``stream``; host copies run at once, as
    on a real accelerator (the fake's own mode would queue the host ones too)."""

    def __init__(self, device: torch.Tensor, stream: FakeStream) -> None:
        super().__init__()
        self.storage, self.stream = device.untyped_storage().data_ptr(), stream

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        touches = [a for a in args if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.storage]
        if func is torch.ops.aten.copy_.default and touches:
            self.stream.enqueue(functools.partial(func, *args, **kwargs))
            return args[0]
        return func(*args, **kwargs)


def _ring(backend: AsyncFakeBackend, slots: int = 3, slot_bytes: int = 64) -> BounceRing:
    return BounceRing([torch.zeros(slot_bytes, dtype=torch.uint8) for _ in range(slots)], backend.event)


def test_ring_waits_for_a_slot_before_reusing_it() -> None:
    backend = AsyncFakeBackend()
    stream = _stream(backend)
    source = torch.arange(100, dtype=torch.float32)  # 400 bytes: 7 pieces over 3 slots
    device = torch.zeros(100)
    ring = _ring(backend)
    with _DeviceCopiesQueued(device, stream):
        ring.to_device(device, source, stream)
    # The host staged 7 pieces through 3 slots: it waited for the device to take the first
    # pieces before overwriting their slots, and the last pieces are still in flight.
    assert 0 < stream.enqueued - stream.completed <= 3
    stream.synchronize()
    assert torch.equal(device, source)


def test_ring_to_host_returns_with_the_host_written() -> None:
    backend = AsyncFakeBackend()
    stream = _stream(backend)
    device = torch.arange(50, dtype=torch.float64)  # 400 bytes
    host = torch.zeros(50, dtype=torch.float64)
    ring = _ring(backend)
    with _DeviceCopiesQueued(device, stream):
        ring.to_host(host, device, stream)
    assert torch.equal(host, device)  # no wait needed after the call
    step = torch.zeros((), dtype=torch.float32)
    ring.to_host(step, torch.tensor(7.0), stream)  # a 0-dim step count
    assert float(step) == 7.0
    with pytest.raises(ValueError, match="contiguous"):
        ring.to_device(torch.zeros(4, 4).t(), torch.zeros(4, 4), stream)
    assert isinstance(backend.event(), FakeEvent)


def test_npu_versions_from_torch_npu_or_the_toolkit(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.5.1.post3"  # type: ignore[attr-defined]
    fake.utils = types.SimpleNamespace(get_cann_version=lambda module: "8.3.RC1")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert npu_versions() == "CANN 8.3.RC1, torch_npu 2.5.1.post3"
    del fake.utils  # before CANN 8.1: the toolkit's install file
    info = tmp_path / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir()
    info.write_text("package_name=Ascend-cann-toolkit\nversion=7.0.0\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert npu_versions() == "CANN 7.0.0, torch_npu 2.5.1.post3"
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME")
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    assert npu_versions() == "CANN unknown, torch_npu unknown"


def test_alloc_host_bytes_falls_back_to_the_pinned_allocator_where_bouncing(one_warning: None) -> None:
    backend = SyncingBackend(synchronizing=True)
    buffer = backend.alloc_host_bytes(3 * PAGE_SIZE, [(0, 3 * PAGE_SIZE)])
    # The registered mapping was refused (copies from it would bounce) and released.
    assert buffer.numel() == 3 * PAGE_SIZE and backend.registered_ranges() == []
    assert not backend.bounces(buffer)
