"""The device layer: CPU path here; CUDA / NPU tests run only where the hardware exists."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
from collections.abc import Iterator

import pytest
import torch

from swap_state.common.segment import plan_segment
from swap_state.client import device
from swap_state.client.device import (
    DEVICE_ENV_VAR,
    PAGE_SIZE,
    REGISTER_CHUNK_BYTES,
    DeviceBackend,
    HostRegistrationError,
    NullEvent,
    NullStream,
    page_chunks,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


needs_npu = pytest.mark.skipif(not _npu_available(), reason="needs an Ascend NPU (torch_npu)")


@pytest.fixture
def keep_process_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that choose the backend again must not leave their choice to later tests."""
    monkeypatch.setattr(device, "_BACKEND", device._BACKEND)


@pytest.fixture
def mapping() -> Iterator[tuple[mmap.mmap, int]]:
    """An anonymous, page-aligned mapping of 3 pages and its address."""
    region = mmap.mmap(-1, 3 * PAGE_SIZE)
    anchor = ctypes.c_char.from_buffer(region)
    yield region, ctypes.addressof(anchor)
    del anchor
    region.close()


def test_cpu_backend_is_a_complete_no_op_accelerator() -> None:
    backend = DeviceBackend("cpu")
    assert backend.type == "cpu" and backend.module is None
    assert not backend.is_accelerator and not backend.pin_memory_available
    assert backend.current_device() == torch.device("cpu")
    side, event = backend.stream(), backend.event()
    assert isinstance(side, NullStream) and isinstance(event, NullEvent)
    with backend.use_stream(side) as current:
        assert current is side
        event.record(side)
    compute = backend.current_stream()
    assert compute is backend.current_stream()
    compute.wait_event(event)
    compute.wait_stream(side)
    assert event.query() and side.query()
    event.synchronize()
    side.synchronize()
    backend.synchronize()
    backend.empty_cache()
    backend.record_stream(torch.zeros(2), side)


def test_set_device_and_blocking_events_go_to_the_device_module() -> None:
    """On an accelerator ``set_device`` and ``event(blocking=True)`` reach the runtime's own
    calls (a stub module here); on CPU they do nothing."""
    calls: list[tuple[str, object]] = []

    class Runtime:
        @staticmethod
        def set_device(device: torch.device) -> None:
            calls.append(("set_device", device))

        @staticmethod
        def Event(**kwargs: object) -> object:  # torch.cuda.Event's name
            calls.append(("Event", kwargs))
            return object()

    backend = DeviceBackend("cuda", module=Runtime)  # type: ignore[arg-type]
    backend.set_device(torch.device("cuda", 3))
    backend.event(blocking=True)
    backend.event()
    assert calls == [("set_device", torch.device("cuda", 3)), ("Event", {"blocking": True}), ("Event", {})]
    cpu = DeviceBackend("cpu")
    cpu.set_device(torch.device("cpu"))
    assert isinstance(cpu.event(blocking=True), NullEvent)


def test_alloc_host_is_zeroed_and_unpinned_on_cpu() -> None:
    host = DeviceBackend("cpu").alloc_host((2, 3), torch.bfloat16)
    assert host.shape == (2, 3) and host.dtype == torch.bfloat16
    assert host.device.type == "cpu" and not host.is_pinned() and not host.any()


def test_unknown_device_type() -> None:
    with pytest.raises(ValueError, match="unknown device type"):
        DeviceBackend("tpu")  # type: ignore[arg-type]


@pytest.mark.usefixtures("keep_process_backend")
def test_selection_and_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    expected = "npu" if _npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    assert device.select_device_type() == expected
    monkeypatch.setenv(DEVICE_ENV_VAR, " CPU ")
    assert device.select_device_type() == "cpu"
    backend = device.get_device_backend(refresh=True)
    assert backend.type == "cpu" and device.get_device_backend() is backend
    monkeypatch.setenv(DEVICE_ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="SWAP_STATE_DEVICE='gpu'"):
        device.select_device_type()


@pytest.mark.parametrize("forced", ["cuda", "npu"])
def test_forcing_a_missing_device_fails_loudly(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    if device._available(forced):  # type: ignore[arg-type]
        pytest.skip(f"{forced} is present here")
    monkeypatch.setenv(DEVICE_ENV_VAR, forced)
    with pytest.raises(RuntimeError, match=f"no {forced} device"):
        device.select_device_type()


def test_page_chunks() -> None:
    page = 4096
    assert page_chunks(0, 1, page_size=page) == [(0, page)]
    assert page_chunks(page, 5 * page, chunk_bytes=2 * page, page_size=page) == [
        (page, 2 * page),
        (3 * page, 2 * page),
        (5 * page, page),
    ]
    # chunk sizes are whole pages, at least one
    assert page_chunks(0, 3 * page, chunk_bytes=page + 7, page_size=page) == [
        (0, page),
        (page, page),
        (2 * page, page),
    ]
    assert page_chunks(0, 2 * page, chunk_bytes=1, page_size=page) == [(0, page), (page, page)]
    assert REGISTER_CHUNK_BYTES % PAGE_SIZE == 0 and REGISTER_CHUNK_BYTES <= 32 << 30
    with pytest.raises(ValueError, match="not aligned"):
        page_chunks(page + 8, page, page_size=page)
    with pytest.raises(ValueError, match="must be positive"):
        page_chunks(0, 0, page_size=page)


def test_page_chunks_end_only_where_a_tensor_starts() -> None:
    page, gib = 4096, 1 << 30
    # Without cuts a 32 GiB boundary falls inside the second tensor; with them it never does,
    # and a tensor over the chunk size is registered alone.
    starts = [page, 20 * gib, 40 * gib]
    total = 80 * gib
    assert page_chunks(0, total, chunk_bytes=32 * gib, page_size=page, cuts=starts) == [
        (0, 20 * gib),
        (20 * gib, 20 * gib),
        (40 * gib, 40 * gib),
    ]
    # A cut that is not page aligned counts from its page.
    assert page_chunks(0, 4 * page, chunk_bytes=2 * page, page_size=page, cuts=[page + 9, 3 * page]) == [
        (0, page),
        (page, 2 * page),
        (3 * page, page),
    ]


def test_a_real_segment_registers_no_tensor_across_two_chunks() -> None:
    """Llama-3-8B's embedding and MLP moments (over 2^31 bytes each) laid out as the server
    lays them out: every registration chunk boundary is a tensor start."""
    specs = [
        (f"{fqn}.{key}", "float32", shape)
        for fqn, shape in (("tok_embeddings", (128256, 4096)), ("w1", (14336, 4096)), ("w2", (4096, 14336)))
        for key in ("exp_avg", "exp_avg_sq")
    ]
    layout = plan_segment(specs, 64 << 20, 4)
    cuts = [t.offset for t in layout.tensors] + [layout.cow_slots_offset]
    chunks = page_chunks(0, layout.size, chunk_bytes=3 << 30, cuts=cuts)
    assert sum(size for _, size in chunks) == layout.size
    for t in layout.tensors:
        inside = [p for p, _ in chunks if t.offset < p < t.offset + t.nbytes]
        assert not inside, (t.name, inside)
    assert max(size for _, size in chunks) <= 3 << 30


def test_cpu_registration_checks_and_bookkeeping(mapping: tuple[mmap.mmap, int]) -> None:
    _, ptr = mapping
    backend = DeviceBackend("cpu")
    registration = backend.register_host_memory(ptr, 2 * PAGE_SIZE + 1)
    assert registration.nbytes == 3 * PAGE_SIZE and registration.chunks == ((ptr, 3 * PAGE_SIZE),)
    assert backend.registered_ranges() == [registration]
    with pytest.raises(ValueError, match="already registered"):
        backend.register_host_memory(ptr, PAGE_SIZE)
    with pytest.raises(ValueError, match="not aligned"):
        backend.register_host_memory(ptr + 16, PAGE_SIZE)
    backend.unregister_host_memory(ptr)
    assert backend.registered_ranges() == []
    with pytest.raises(KeyError):
        backend.unregister_host_memory(ptr)


class FlakyBackend(DeviceBackend):
    """Registration calls go to a fake runtime that fails on a chosen chunk."""

    def __init__(self, fail_register_at: int = -1, fail_unregister: bool = False) -> None:
        super().__init__("cpu", chunk_bytes=PAGE_SIZE)
        self.calls: list[tuple[str, int]] = []
        self.fail_register_at = fail_register_at
        self.fail_unregister = fail_unregister

    def _register_chunk(self, ptr: int, nbytes: int) -> int:
        self.calls.append(("register", ptr))
        return 701 if len([c for c in self.calls if c[0] == "register"]) - 1 == self.fail_register_at else 0

    def _unregister_chunk(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 713 if self.fail_unregister else 0


def test_failed_chunk_rolls_back_and_reports_code_and_range() -> None:
    backend = FlakyBackend(fail_register_at=2)
    base = 1 << 30  # never dereferenced: the fake runtime only records addresses
    with pytest.raises(HostRegistrationError) as info:
        backend.register_host_memory(base, 4 * PAGE_SIZE)
    error = info.value
    assert error.return_code == 701 and error.ptr == base + 2 * PAGE_SIZE and error.nbytes == PAGE_SIZE
    message = str(error)
    assert "return code 701" in message
    assert f"{base + 2 * PAGE_SIZE:#x}" in message and f"[{base:#x}, {base + 4 * PAGE_SIZE:#x})" in message
    assert backend.calls == [
        ("register", base),
        ("register", base + PAGE_SIZE),
        ("register", base + 2 * PAGE_SIZE),
        ("unregister", base),
        ("unregister", base + PAGE_SIZE),
    ]
    assert backend.registered_ranges() == []


def test_failed_unregister_still_unregisters_every_chunk_and_raises() -> None:
    backend = FlakyBackend(fail_unregister=True)
    base = 1 << 30
    backend.register_host_memory(base, 3 * PAGE_SIZE)
    with pytest.raises(HostRegistrationError, match="return code 713"):
        backend.unregister_host_memory(base)
    assert [c for c in backend.calls if c[0] == "unregister"] == [
        ("unregister", base),
        ("unregister", base + PAGE_SIZE),
        ("unregister", base + 2 * PAGE_SIZE),
    ]


@pytest.mark.cuda
@needs_cuda
def test_cuda_streams_events_and_pinned_alloc() -> None:
    backend = DeviceBackend("cuda")
    assert backend.current_device().type == "cuda" and backend.pin_memory_available
    host = backend.alloc_host((1024,), torch.float32)
    assert host.is_pinned()
    side = backend.stream()
    with backend.use_stream(side):
        device_buffer = torch.empty_like(host, device=backend.current_device())
        device_buffer.copy_(host + 1, non_blocking=True)
        ready = backend.event()
        ready.record(side)
    backend.current_stream().wait_event(ready)
    backend.record_stream(device_buffer, side)
    assert float(device_buffer.sum()) == 1024.0
    backend.synchronize()
    backend.empty_cache()


@pytest.mark.cuda
@needs_cuda
def test_cuda_register_host_memory_in_chunks() -> None:
    backend = DeviceBackend("cuda", chunk_bytes=2 * PAGE_SIZE)
    region = mmap.mmap(-1, 5 * PAGE_SIZE)
    host = torch.frombuffer(region, dtype=torch.uint8)
    registration = backend.register_host_memory(host.data_ptr(), 5 * PAGE_SIZE)
    try:
        assert len(registration.chunks) == 3
        assert host[:PAGE_SIZE].is_pinned()
        host.fill_(7)
        on_device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(on_device.sum()) == 7 * 5 * PAGE_SIZE
        with pytest.raises(HostRegistrationError, match="return code"):
            DeviceBackend("cuda").register_host_memory(host.data_ptr(), PAGE_SIZE)  # registered twice
    finally:
        backend.unregister_host_memory(host.data_ptr())
        del host
        region.close()


@pytest.mark.npu
@needs_npu
def test_npu_streams_events_and_registration() -> None:
    backend = DeviceBackend("npu")
    assert backend.current_device().type == "npu" and backend.alloc_host((8,), torch.float32).is_pinned()
    side = backend.stream()
    with backend.use_stream(side):
        ready = backend.event()
        ready.record(side)
    backend.current_stream().wait_event(ready)
    backend.synchronize()
    chunked = DeviceBackend("npu", chunk_bytes=2 * PAGE_SIZE)
    region = mmap.mmap(-1, 4 * PAGE_SIZE)
    host = torch.frombuffer(region, dtype=torch.uint8)
    registration = chunked.register_host_memory(host.data_ptr(), 4 * PAGE_SIZE)
    try:
        assert len(registration.chunks) == 2
        host.fill_(3)
        on_device = host.to(backend.current_device(), non_blocking=True)
        backend.synchronize()
        assert int(on_device.sum()) == 3 * 4 * PAGE_SIZE
    finally:
        chunked.unregister_host_memory(host.data_ptr())
        del host
        region.close()
