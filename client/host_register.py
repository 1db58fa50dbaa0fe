"""Host memory registration for DMA: page-aligned chunks, the vendor calls (CUDA's
``cudaHostRegister``, Ascend's ``aclrtHostRegister`` through ctypes) and an exactly sized
registered host buffer (torch's pinned allocator rounds up to a power of two).
:class:`~swap_state.client.device.DeviceBackend` calls these and keeps the bookkeeping.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import logging
import mmap
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PAGE_SIZE", "REGISTER_CHUNK_BYTES", "HostRegistration", "HostRegistrationError", "locate_library",
    "page_chunks", "registered_host_buffer", "release_host_buffers",
]

logger = logging.getLogger(__name__)

#: Largest single host registration call. Calls of ~100 GiB are reported to fail on
#: CUDA and Ascend; 32 GiB is a multiple of every page size in use (4 KiB .. 1 GiB).
REGISTER_CHUNK_BYTES = 32 << 30

#: The host page size; registration pointers must be aligned to it.
PAGE_SIZE = mmap.PAGESIZE

# cudaHostRegisterPortable: the range counts as pinned for every CUDA context of the
# process, not only the current one.
_CUDA_HOST_REGISTER_PORTABLE = 1
# ACL_HOST_REGISTER_MAPPED: the only aclrtHostRegisterType.
_ACL_HOST_REGISTER_MAPPED = 0


class HostRegistrationError(RuntimeError):
    """A host register/unregister call failed: ``return_code``, and the chunk ``ptr``/``nbytes``."""

    def __init__(self, message: str, *, return_code: int, ptr: int, nbytes: int) -> None:
        super().__init__(message)
        self.return_code = return_code
        self.ptr = ptr
        self.nbytes = nbytes


@dataclass(frozen=True)
class HostRegistration:
    """A registered host range: page-rounded size and the chunks it was registered in."""

    ptr: int
    nbytes: int
    chunks: tuple[tuple[int, int], ...]


def page_chunks(
    ptr: int, nbytes: int, chunk_bytes: int = REGISTER_CHUNK_BYTES, page_size: int = PAGE_SIZE,
    cuts: Sequence[int] = (), spans: Sequence[tuple[int, int]] = (),
) -> list[tuple[int, int]]:
    """Split ``[ptr, ptr + nbytes)`` (page-aligned; size rounded up) into chunks of at most
    ``chunk_bytes``. With ``spans`` (tensors' ``(offset, nbytes)``) or ``cuts`` (tensor starts),
    a chunk ends only on a page boundary no tensor straddles, so one copy never spans two
    registrations (how a driver treats that is not documented); a tensor over ``chunk_bytes``
    gets a chunk of its own, over the limit (a Llama-3-405B embedding moment is 8.4 GB: far
    below ~100 GiB)."""
    if ptr % page_size:
        raise ValueError(
            f"host pointer {ptr:#x} is not aligned to the {page_size}-byte page size; "
            "DMA registration needs a page-aligned pointer (map the region with mmap)"
        )
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


def _chunk_ends(
    total: int, page_size: int, cuts: Sequence[int], spans: Sequence[tuple[int, int]]
) -> list[int]:
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
    clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if clear is None:
        library = _loaded_library("libcudart.so")
        clear = None if library is None else library.cudaGetLastError
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
    for path in sorted(paths):
        if path.startswith("/"):
            return open_library(path)
    return None


def locate_library(name: str, symbol: str, open_library: Callable[..., Any] = ctypes.CDLL) -> tuple[Any, str]:
    """``name`` as this process already has it, ``(library, where)``: the global symbols, a
    mapping in ``/proc/self/maps`` (torch_npu loads ``libascendcl`` privately), then the loader's
    path. A second copy has its own runtime state, and torch_npu would not see its registrations.
    """
    process = open_library(None)
    if hasattr(process, symbol):
        return process, "the process's global symbols"
    loaded = _loaded_library(name, open_library)
    if loaded is not None and hasattr(loaded, symbol):
        return loaded, "the copy already mapped in this process"
    return open_library(name, mode=ctypes.RTLD_GLOBAL), "the loader's search path"


# -- Ascend through libascendcl ----------------------------------------------------------------
_ACL_LIB: Any = None


def _acl() -> Any:
    global _ACL_LIB
    if _ACL_LIB is None:
        lib, where = locate_library("libascendcl.so", "aclrtHostRegister")
        logger.debug("libascendcl from %s", where)
        out = ctypes.POINTER(ctypes.c_void_p)
        lib.aclrtHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, out]
        lib.aclrtHostRegister.restype = ctypes.c_int
        lib.aclrtHostUnregister.argtypes = [ctypes.c_void_p]
        lib.aclrtHostUnregister.restype = ctypes.c_int
        _ACL_LIB = lib
    return _ACL_LIB


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


def registered_host_buffer(
    nbytes: int, register: Callable[[int, int], Any], unregister: Callable[[int], Any]
) -> torch.Tensor:
    """A zero-filled, page-aligned uint8 tensor of exactly ``nbytes`` over a new registered mapping."""
    arena = _HostArena(-1, max(nbytes, 1))
    buffer = torch.frombuffer(arena, dtype=torch.uint8)[:nbytes]
    register(buffer.data_ptr(), len(arena))
    arena.release = functools.partial(unregister, buffer.data_ptr())
    return buffer
