"""Host registration: chunks that never split a tensor, the libascendcl already loaded found
first, and the exactly sized registered buffer that unregisters with its last tensor."""

from __future__ import annotations

import ctypes
import functools
import gc
from typing import Any

import pytest
import torch

from swap_state.client import host_register
from swap_state.client.device import PAGE_SIZE, DeviceBackend, HostRegistrationError
from swap_state.client.host_register import locate_library, page_chunks, registered_host_buffer

PAGE = 4096


def _boundaries_inside(chunks: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Chunk starts that fall strictly inside a tensor."""
    return [p for p, _ in chunks for off, n in spans if off < p < off + n]


def test_spans_keep_unaligned_tensors_in_one_chunk() -> None:
    # Tensors that share pages: a chunk may end only where no tensor straddles the page
    # boundary; the 20000-byte tensor exceeds the 3-page limit and is registered alone.
    spans = [(0, 5000), (5000, 3000), (8192, 20000), (28192, 100)]
    chunks = page_chunks(0, 10 * PAGE, chunk_bytes=3 * PAGE, page_size=PAGE, spans=spans)
    assert chunks == [(0, 2 * PAGE), (2 * PAGE, 5 * PAGE), (7 * PAGE, 3 * PAGE)]
    assert not _boundaries_inside(chunks, spans)
    # Tensor starts alone (cuts) round down to their page and split the tensor before them.
    by_starts = page_chunks(0, 10 * PAGE, 3 * PAGE, PAGE, cuts=[off for off, _ in spans])
    assert _boundaries_inside(by_starts, spans)


def test_spans_overlapping_tensors_and_the_limit_where_it_can_hold() -> None:
    # Two views over the same bytes count as one tensor; page-aligned tensors under the limit
    # give chunks under the limit, every boundary between tensors.
    spans = [(0, PAGE), (PAGE, 3 * PAGE), (2 * PAGE, 3 * PAGE), (5 * PAGE, PAGE), (6 * PAGE, 2 * PAGE)]
    chunks = page_chunks(1 << 20, 8 * PAGE, chunk_bytes=4 * PAGE, page_size=PAGE, spans=spans)
    assert chunks == [(1 << 20, PAGE), ((1 << 20) + PAGE, 4 * PAGE), ((1 << 20) + 5 * PAGE, 3 * PAGE)]
    rebased = [((1 << 20) + off, n) for off, n in spans]
    assert not _boundaries_inside(chunks, rebased)
    aligned = [(i * 2 * PAGE, 2 * PAGE) for i in range(8)]
    chunks = page_chunks(0, 16 * PAGE, chunk_bytes=5 * PAGE, page_size=PAGE, spans=aligned)
    assert max(size for _, size in chunks) <= 5 * PAGE and sum(size for _, size in chunks) == 16 * PAGE
    assert not _boundaries_inside(chunks, aligned)


class _Library:
    def __init__(self, path: str | None, symbols: set[str]) -> None:
        self.path, self.symbols = path, symbols

    def __getattr__(self, name: str) -> Any:
        if name in self.symbols:
            return object()
        raise AttributeError(name)


def test_the_library_already_in_the_process_is_found_first() -> None:
    # Real: libc's malloc is among the process's global symbols.
    assert locate_library("libc.so", "malloc")[1] == "the process's global symbols"
    opened: list[tuple[str | None, int]] = []

    def opener(global_has: bool, mapped_has: bool):
        def open_library(path: str | None, mode: int = 0) -> _Library:
            opened.append((path, mode))
            has = global_has if path is None else mapped_has if path.startswith("/") else True
            return _Library(path, {"aclrtHostRegister"} if has else set())

        return open_library

    # libc.so is mapped in this process, so /proc/self/maps lists it (the stand-in here).
    lib, where = locate_library("libc.so", "aclrtHostRegister", opener(False, True))
    assert where == "the copy already mapped in this process" and lib.path.startswith("/")
    opened.clear()
    lib, where = locate_library("libc.so", "aclrtHostRegister", opener(False, False))
    assert where == "the loader's search path" and opened[-1] == ("libc.so", ctypes.RTLD_GLOBAL)


def test_registered_buffer_is_exact_and_unregisters_with_its_last_view() -> None:
    calls: list[tuple[str, int, int]] = []
    buffer = registered_host_buffer(
        3 * PAGE_SIZE + 5,
        lambda ptr, n: calls.append(("register", ptr, n)),
        lambda ptr: calls.append(("unregister", ptr, 0)),
    )
    ptr = buffer.data_ptr()
    assert buffer.numel() == 3 * PAGE_SIZE + 5 and ptr % PAGE_SIZE == 0 and not buffer.any()
    assert calls == [("register", ptr, 3 * PAGE_SIZE + 5)]  # the backend rounds to pages
    view = buffer[PAGE_SIZE:].view(torch.uint8)
    del buffer
    gc.collect()
    view.fill_(1)  # still mapped and registered
    assert len(calls) == 1
    del view
    gc.collect()
    assert len(calls) == 1  # queued: released at a safe point, never inside a collection
    host_register.release_host_buffers()
    assert calls[-1] == ("unregister", ptr, 0)


def test_failed_registration_leaves_nothing_registered() -> None:
    def refuse(ptr: int, nbytes: int) -> None:
        raise HostRegistrationError("refused", return_code=7, ptr=ptr, nbytes=nbytes)

    unregistered: list[int] = []
    with pytest.raises(HostRegistrationError):
        registered_host_buffer(100, refuse, unregistered.append)
    gc.collect()
    host_register.release_host_buffers()
    assert unregistered == []


class PinnedCPU(DeviceBackend):
    """The CPU claiming pinned memory: the accelerator allocation paths run, unpinned, and
    registration keeps its bookkeeping (nothing is called)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("cpu", **kwargs)

    @property
    def pin_memory_available(self) -> bool:
        return True

    def alloc_host(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype)


def test_alloc_host_bytes_registers_between_tensors_and_releases() -> None:
    backend = PinnedCPU(chunk_bytes=2 * PAGE_SIZE)
    spans = [(0, PAGE_SIZE + 1), (PAGE_SIZE + 512, 2 * PAGE_SIZE), (4 * PAGE_SIZE, 8)]
    buffer = backend.alloc_host_bytes(4 * PAGE_SIZE + 8, spans)
    (registration,) = backend.registered_ranges()
    assert registration.ptr == buffer.data_ptr() and registration.nbytes == 5 * PAGE_SIZE
    base = buffer.data_ptr()
    assert not _boundaries_inside(list(registration.chunks), [(base + o, n) for o, n in spans])
    del buffer
    gc.collect()
    assert backend.registered_ranges() == []
    # On a plain CPU backend: an ordinary zeroed tensor, nothing registered.
    cpu = DeviceBackend("cpu")
    assert cpu.alloc_host_bytes(10).numel() == 10 and cpu.registered_ranges() == []


def test_module_reads_acl_through_locate_library(monkeypatch: pytest.MonkeyPatch) -> None:
    found: list[tuple[str, str]] = []

    class Acl:
        def __init__(self) -> None:
            self.aclrtHostRegister = lambda *args: 0
            self.aclrtHostUnregister = lambda *args: 0

    def locate(name: str, symbol: str) -> tuple[Any, str]:
        found.append((name, symbol))
        return Acl(), "the process's global symbols"

    monkeypatch.setattr(host_register, "_acl", functools.cache(host_register._acl.__wrapped__))  # a fresh cache
    monkeypatch.setattr(host_register, "locate_library", locate)
    assert host_register._acl_host_unregister(PAGE_SIZE) == 0
    assert found == [("libascendcl.so", "aclrtHostRegister")]
