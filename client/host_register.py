"""Host memory registration for DMA (page-aligned chunks, CUDA's and Ascend's calls), exactly sized
registered host buffers, and on Ascend the probe of a registration's copies and the pinned bounce
ring for those that are not asynchronous; :class:`~swap_state.client.device.DeviceBackend` calls these.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import functools
import glob
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BOUNCE_SLOTS", "BOUNCE_SLOT_BYTES", "PAGE_SIZE", "PROBE_MARGIN_S", "PROBE_SLOWDOWN", "REGISTER_CHUNK_BYTES",
    "BounceRing", "CopyProbe", "HostRegistration", "HostRegistrationError", "ProbeConfig", "copies_are_async",
    "locate_library", "needs_bounce", "npu_versions", "page_chunks", "probe_registered_copies",
    "registered_host_buffer", "release_host_buffers"]

logger = logging.getLogger(__name__)

#: Largest single host registration call. Calls of ~100 GiB are reported to fail on
#: CUDA and Ascend; 32 GiB is a multiple of every page size in use (4 KiB .. 1 GiB).
REGISTER_CHUNK_BYTES = 32 << 30

PAGE_SIZE = mmap.PAGESIZE  # registration pointers must be aligned to it

# cudaHostRegisterPortable: the range counts as pinned for every CUDA context of the process, not only the current one.
_CUDA_HOST_REGISTER_PORTABLE = 1
# ACL_HOST_REGISTER_MAPPED: the only aclrtHostRegisterType.
_ACL_HOST_REGISTER_MAPPED = 0


class HostRegistrationError(RuntimeError):
    """A host register/unregister call failed: ``return_code``, and the chunk ``ptr``/``nbytes``."""

    def __init__(self, message: str, *, return_code: int, ptr: int, nbytes: int) -> None:
        super().__init__(message)
        self.return_code, self.ptr, self.nbytes = return_code, ptr, nbytes


@dataclass(frozen=True)
class HostRegistration:
    """A registered host range: page-rounded size and the chunks it was registered in."""

    ptr: int
    nbytes: int
    chunks: tuple[tuple[int, int], ...]


def page_chunks(ptr: int, nbytes: int, chunk_bytes: int = REGISTER_CHUNK_BYTES, page_size: int = PAGE_SIZE,
                cuts: Sequence[int] = (), spans: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Split ``[ptr, ptr + nbytes)`` (page-aligned; size rounded up) into chunks of at most ``chunk_bytes``. With
    ``spans`` (tensors' ``(offset, nbytes)``) or ``cuts`` (tensor starts), a chunk ends only on a page boundary no
    tensor straddles, so one copy never spans two registrations (how a driver treats that is not documented); a tensor
    over ``chunk_bytes`` gets a chunk of its own, over the limit."""
    if ptr % page_size:
        raise ValueError(f"host pointer {ptr:#x} is not aligned to the {page_size}-byte page size; "
                         "DMA registration needs a page-aligned pointer (map the region with mmap)")
    if nbytes <= 0:
        raise ValueError(f"cannot register {nbytes} bytes at {ptr:#x}: size must be positive")
    total = -(-nbytes // page_size) * page_size
    step = max(page_size, chunk_bytes - chunk_bytes % page_size)
    if not cuts and not spans:
        return [(ptr + off, min(step, total - off)) for off in range(0, total, step)]
    ends = _chunk_ends(total, page_size, cuts, spans)
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < total:
        within = bisect.bisect_right(ends, start + step) - 1
        end = ends[within] if within >= 0 and ends[within] > start else ends[bisect.bisect_right(ends, start)]
        chunks.append((ptr + start, end - start))
        start = end
    return chunks


def _chunk_ends(total: int, page_size: int, cuts: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """The sorted page boundaries in ``(0, total]`` a chunk may end at (see :func:`page_chunks`)."""
    candidates = {cut - cut % page_size for cut in cuts}
    for offset, size in spans:
        candidates |= {offset - offset % page_size, -(-(offset + size) // page_size) * page_size}
    # Overlapping spans merged (touching ones not: a boundary between two tensors is fine).
    merged: list[list[int]] = []
    for offset, size in sorted(spans):
        if merged and offset < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + size)
        elif size > 0:
            merged.append([offset, offset + size])
    starts = [span[0] for span in merged]

    def inside_a_tensor(boundary: int) -> bool:
        index = bisect.bisect_left(starts, boundary) - 1
        return index >= 0 and boundary < merged[index][1]

    return sorted({b for b in candidates if 0 < b < total and not inside_a_tensor(b)} | {total})


# -- CUDA through torch.cuda.cudart() -------------------------------------------------------
def _cuda_host_register(ptr: int, nbytes: int) -> int:
    return _cuda_return_code(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))


def _cuda_host_unregister(ptr: int) -> int:
    return _cuda_return_code(torch.cuda.cudart().cudaHostUnregister(ptr))


def _cuda_error_string(rc: int) -> str:
    try:
        cudart = torch.cuda.cudart()
        return str(cudart.cudaGetErrorString(cudart.cudaError(rc)))
    except Exception:  # the description is best effort; the code is what counts
        return "cudaError"


def _cuda_return_code(rc: Any) -> int:
    """``rc`` as an int; an error is cleared from the thread's "last error", which torch checks
    after kernel launches (it would blame an unrelated kernel)."""
    rc = int(rc)
    if rc == 0:
        return rc
    clear = (getattr(torch.cuda.cudart(), "cudaGetLastError", None)
             or getattr(_loaded_library("libcudart.so"), "cudaGetLastError", None))
    if clear is not None:
        clear()
    return rc


def _loaded_library(name: str, open_library: Callable[..., Any] = ctypes.CDLL) -> Any:
    """The copy of ``name`` this process has already loaded (same runtime state), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if name in line}
    except OSError:
        return None
    path = next((path for path in sorted(paths) if path.startswith("/")), None)
    return None if path is None else open_library(path)


def locate_library(name: str, symbol: str, open_library: Callable[..., Any] = ctypes.CDLL) -> tuple[Any, str]:
    """``(library, where)``: ``name`` as this process already has it (global symbols, a mapping in
    ``/proc/self/maps``: torch_npu loads ``libascendcl`` privately), else from the loader's path. A
    second copy has its own runtime state, and torch_npu would not see its registrations."""
    process = open_library(None)
    if hasattr(process, symbol):
        return process, "the process's global symbols"
    loaded = _loaded_library(name, open_library)
    if loaded is not None and hasattr(loaded, symbol):
        return loaded, "the copy already mapped in this process"
    return open_library(name, mode=ctypes.RTLD_GLOBAL), "the loader's search path"


# -- Ascend through libascendcl ----------------------------------------------------------------
@functools.cache
def _acl() -> Any:
    lib, where = locate_library("libascendcl.so", "aclrtHostRegister")
    logger.debug("libascendcl from %s", where)
    out = ctypes.POINTER(ctypes.c_void_p)
    lib.aclrtHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, out]
    lib.aclrtHostRegister.restype = ctypes.c_int
    lib.aclrtHostUnregister.argtypes = [ctypes.c_void_p]
    lib.aclrtHostUnregister.restype = ctypes.c_int
    return lib


def _acl_host_register(ptr: int, nbytes: int) -> int:
    device_ptr = ctypes.c_void_p()
    mapped = _ACL_HOST_REGISTER_MAPPED
    return int(_acl().aclrtHostRegister(ctypes.c_void_p(ptr), nbytes, mapped, ctypes.byref(device_ptr)))


def _acl_host_unregister(ptr: int) -> int:
    return int(_acl().aclrtHostUnregister(ctypes.c_void_p(ptr)))


# -- an exactly sized, registered host buffer --------------------------------------------------
class _HostArena(mmap.mmap):
    """A mapping with a ``release`` (unregister); ``__del__`` only queues it, for
    :func:`release_host_buffers`: a tensor may die in a garbage collection inside the lock."""

    release: Callable[[], Any] | None = None

    def __del__(self) -> None:
        # Exiting: the process's mappings and registrations end with it.
        if self.release is not None and not sys.is_finalizing():
            _RELEASED.append(self)  # resurrected (PEP 442): mapped until released


_RELEASED: collections.deque[_HostArena] = collections.deque()


def release_host_buffers() -> None:
    """Unregister, then unmap, every :func:`registered_host_buffer` whose last tensor has
    gone. Call where no registration lock is held (the backend does, before it registers)."""
    while _RELEASED:
        try:
            arena = _RELEASED.popleft()
        except IndexError:  # another thread took the last one
            return
        release, arena.release = arena.release, None
        try:
            if release is not None:
                release()
        except Exception:  # one failure must not keep the others pinned
            logger.exception("unregistering a host buffer failed")
        del arena  # unmapped here (its __del__ has run once already)


def registered_host_buffer(nbytes: int, register: Callable[[int, int], Any],
                           unregister: Callable[[int], Any]) -> torch.Tensor:
    """A zero-filled, page-aligned uint8 tensor of exactly ``nbytes`` over a new registered mapping."""
    arena = _HostArena(-1, max(nbytes, 1))
    buffer = torch.frombuffer(arena, dtype=torch.uint8)[:nbytes]
    register(buffer.data_ptr(), len(arena))
    arena.release = functools.partial(unregister, buffer.data_ptr())
    return buffer


# -- Ascend: older torch_npu synchronizes after each non-blocking copy from memory it did not
# allocate (and CANN's docs warn about unlocked memory on kernels <= 5.10), so a registration is
# probed and, where its copies are not asynchronous, they go through a ring of pinned buffers.

#: The bounce ring: slots x bytes of pinned memory (the host stages a few pieces ahead).
BOUNCE_SLOTS = 4
BOUNCE_SLOT_BYTES = 8 << 20


def npu_versions() -> str:
    """``"CANN <v>, torch_npu <v>"`` as far as they can be read (for the fallback's warning)."""
    torch_npu = sys.modules.get("torch_npu")
    cann = ""
    # No such call before CANN 8.1: the toolkit's install file has the version then.
    with contextlib.suppress(Exception):
        cann = str(torch_npu.utils.get_cann_version(module="CANN"))  # type: ignore[union-attr]
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH") or ""
    for info in sorted(glob.glob(os.path.join(home, "*", "ascend_toolkit_install.info"))) if home else ():
        if cann:
            break
        with contextlib.suppress(OSError), open(info, encoding="utf-8") as lines:
            cann = next((line.split("=", 1)[1].strip() for line in lines if line.startswith("version=")), "")
    return f"CANN {cann or 'unknown'}, torch_npu {getattr(torch_npu, '__version__', 'unknown')}"


@dataclass(frozen=True)
class ProbeConfig:
    """The probe's bytes, and device work enqueued first so that an async copy is still pending."""

    nbytes: int = 4 << 20
    busy_side: int = 2048
    busy_matmuls: int = 8


@dataclass(frozen=True)
class CopyProbe:
    """A copy from the registered range and one from pinned memory: pending on return, and time."""

    registered_pending: bool
    registered_seconds: float
    pinned_pending: bool
    pinned_seconds: float


#: A registered copy call this many times slower than the pinned one (and by more than
#: PROBE_MARGIN_S) waited for its copy: the runtime synchronized after it.
PROBE_SLOWDOWN = 4.0
PROBE_MARGIN_S = 1e-3


def copies_are_async(probe: CopyProbe) -> bool:
    """Whether copies from the registered range are asynchronous: pending, yes; not pending
    while the pinned one was, no; neither pending: by the call times."""
    if probe.registered_pending:
        return True
    if probe.pinned_pending:
        return False
    return probe.registered_seconds <= max(PROBE_SLOWDOWN * probe.pinned_seconds, probe.pinned_seconds + PROBE_MARGIN_S)


def probe_registered_copies(backend: Any, ptr: int, nbytes: int, config: ProbeConfig = ProbeConfig()) -> CopyProbe:
    """Time a non-blocking H2D copy from ``[ptr, ptr + nbytes)`` (only read) against one from
    pinned memory, each on a side stream behind ``config``'s device work."""
    size = min(config.nbytes, nbytes)
    device = backend.current_device()
    registered = torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)
    sources = (backend.alloc_host((size,), torch.uint8), registered)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    busy = torch.zeros((2, config.busy_side, config.busy_side), device=device)
    stream = backend.stream()
    measured: list[tuple[bool, float]] = []
    for source in (sources[0], *sources):  # the first, unmeasured: the runtime's lazy setup
        with backend.use_stream(stream):
            for _ in range(config.busy_matmuls):
                torch.mm(busy[0], busy[0], out=busy[1])
            started = time.perf_counter()
            target.copy_(source, non_blocking=True)
            seconds = time.perf_counter() - started
            done = backend.event()
            done.record(stream)
            measured.append((not done.query(), seconds))
        stream.synchronize()
    (pinned_pending, pinned_s), (registered_pending, registered_s) = measured[1:]
    return CopyProbe(registered_pending, registered_s, pinned_pending, pinned_s)


_WARNED_SYNCHRONOUS = False


def needs_bounce(backend: Any, ptr: int, nbytes: int) -> bool:
    """Whether copies from a new registration must bounce (after the process's one WARNING).
    A probe that fails says False: a check must not fail what it checks."""
    global _WARNED_SYNCHRONOUS
    try:
        probe = probe_registered_copies(backend, ptr, nbytes, backend.copy_probe)
    except Exception as exc:
        logger.warning("could not probe copies from registered host memory (%s); copying directly", exc)
        return False
    if copies_are_async(probe):
        return False
    if not _WARNED_SYNCHRONOUS:
        _WARNED_SYNCHRONOUS = True
        versions = npu_versions() if backend.type == "npu" else f"{backend.type}, torch {torch.__version__}"
        logger.warning(
            "%s: a non-blocking copy from memory registered with aclrtHostRegister is not "
            "asynchronous (the host waited %.2f ms, %.2f ms from pinned memory); copies from "
            "registered host memory go through a small ring of pinned bounce buffers from now on "
            "(slower than direct DMA; a torch_npu / CANN that honours aclrtHostRegister avoids it)",
            versions, probe.registered_seconds * 1e3, probe.pinned_seconds * 1e3,
        )  # fmt: skip
    return True


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("a bounced copy needs contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


class BounceRing:
    """Pinned staging slots, used round robin, for copies between unpinned host memory and the
    device. ``to_device`` returns once every piece is enqueued; ``to_host`` once ``dst`` holds
    every byte (the host writes it, so an event on ``stream`` could not vouch for it)."""

    def __init__(self, slots: Sequence[torch.Tensor], new_event: Callable[[], Any]) -> None:
        if not slots:
            raise ValueError("a bounce ring needs at least one slot")
        self._slots = [_flat_bytes(slot) for slot in slots]
        self._events: list[Any] = [None] * len(slots)
        self._new_event = new_event
        self._next = 0
        self._lock = threading.RLock()
        self.pieces = 0  # pieces staged so far, both ways

    def _take(self) -> int:
        """The next slot, once its last copy has completed."""
        index, self._next = self._next, (self._next + 1) % len(self._slots)
        self._wait(index)
        self.pieces += 1
        return index

    def _wait(self, index: int) -> None:
        event, self._events[index] = self._events[index], None
        if event is not None:
            event.synchronize()

    def _mark(self, index: int, stream: Any) -> None:
        event = self._new_event()
        event.record(stream)
        self._events[index] = event

    def _pieces(self, nbytes: int) -> list[tuple[int, int]]:
        size = min(len(slot) for slot in self._slots)
        return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)]

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        source, target = _flat_bytes(src), _flat_bytes(dst)
        with self._lock:
            for start, size in self._pieces(source.numel()):
                index = self._take()
                slot = self._slots[index][:size]
                slot.copy_(source[start : start + size])
                target[start : start + size].copy_(slot, non_blocking=True)
                self._mark(index, stream)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        source, target = _flat_bytes(src), _flat_bytes(dst)
        in_flight: list[tuple[int, int, int]] = []

        def land(index: int, start: int, size: int) -> None:
            self._wait(index)
            target[start : start + size].copy_(self._slots[index][:size])

        with self._lock:
            for start, size in self._pieces(source.numel()):
                if len(in_flight) == len(self._slots):
                    land(*in_flight.pop(0))
                index = self._take()
                self._slots[index][:size].copy_(source[start : start + size], non_blocking=True)
                self._mark(index, stream)
                in_flight.append((index, start, size))
            for piece in in_flight:
                land(*piece)

