"""Host memory registration for DMA: the page-aligned chunks a range is registered in, and
the vendor calls (CUDA's ``cudaHostRegister`` through ``torch.cuda.cudart()``, Ascend's
``aclrtHostRegister`` from the ``libascendcl`` torch_npu has loaded, through ctypes).

:class:`~swap_state.client.device.DeviceBackend` calls these and keeps the bookkeeping
(which ranges are registered, rollback of a partial registration); every call's return code
is checked there.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PAGE_SIZE",
    "REGISTER_CHUNK_BYTES",
    "HostRegistration",
    "HostRegistrationError",
    "page_chunks",
]

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
    """A host register/unregister call returned an error code.

    ``return_code`` is the runtime's code, ``ptr``/``nbytes`` the chunk that failed.
    """

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
    ptr: int,
    nbytes: int,
    chunk_bytes: int = REGISTER_CHUNK_BYTES,
    page_size: int = PAGE_SIZE,
    cuts: Sequence[int] = (),
) -> list[tuple[int, int]]:
    """Split ``[ptr, ptr + nbytes)`` into page-aligned ``(ptr, size)`` chunks.

    ``ptr`` must be page-aligned; ``nbytes`` is rounded up to whole pages (a mapping
    always covers whole pages). Without ``cuts`` every chunk but the last is
    ``chunk_bytes`` rounded down to whole pages (at least one page).

    ``cuts``: byte offsets from ``ptr`` where a chunk may end (where the tensors start, each
    rounded down to its page). A chunk then ends at the last cut within ``chunk_bytes`` of
    its start, or, where one span between cuts is longer, at the next cut: one copy never
    spans two registrations (how a driver treats such a copy is not documented), and a
    single tensor over ``chunk_bytes`` gets one registration of its own.
    """
    if ptr % page_size:
        raise ValueError(
            f"host pointer {ptr:#x} is not aligned to the {page_size}-byte page size; "
            "DMA registration needs a page-aligned pointer (map the region with mmap)"
        )
    if nbytes <= 0:
        raise ValueError(f"cannot register {nbytes} bytes at {ptr:#x}: size must be positive")
    total = -(-nbytes // page_size) * page_size
    step = max(page_size, chunk_bytes - chunk_bytes % page_size)
    if not cuts:
        return [(ptr + off, min(step, total - off)) for off in range(0, total, step)]
    ends = sorted({cut - cut % page_size for cut in cuts if 0 < cut < total} | {total})
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < total:
        within = bisect.bisect_right(ends, start + step) - 1
        end = ends[within] if within >= 0 and ends[within] > start else ends[bisect.bisect_right(ends, start)]
        chunks.append((ptr + start, end - start))
        start = end
    return chunks


# -- CUDA through torch.cuda.cudart() -------------------------------------------------------
def _cudart() -> Any:
    return torch.cuda.cudart()


def _cuda_host_register(ptr: int, nbytes: int) -> int:
    rc = int(_cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if rc != 0:
        _clear_cuda_error()
    return rc


def _cuda_host_unregister(ptr: int) -> int:
    rc = int(_cudart().cudaHostUnregister(ptr))
    if rc != 0:
        _clear_cuda_error()
    return rc


def _cuda_error_string(rc: int) -> str:
    try:
        cudart = _cudart()
        return str(cudart.cudaGetErrorString(cudart.cudaError(rc)))
    except Exception:  # the description is best effort; the code is what counts
        return "cudaError"


def _clear_cuda_error() -> None:
    # A failed runtime call leaves its code as the thread's "last error"; torch checks
    # cudaGetLastError after kernel launches and would blame an unrelated kernel.
    clear = getattr(_cudart(), "cudaGetLastError", None)
    if clear is None:
        library = _loaded_library("libcudart.so")
        clear = None if library is None else library.cudaGetLastError
    if clear is not None:
        clear()


def _loaded_library(name: str) -> ctypes.CDLL | None:
    """The copy of ``name`` this process has already loaded (same runtime state), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if name in line}
    except OSError:
        return None
    for path in sorted(paths):
        if path.startswith("/"):
            return ctypes.CDLL(path)
    return None


# -- Ascend through libascendcl ----------------------------------------------------------------
_ACL_LIB: ctypes.CDLL | None = None


def _acl() -> ctypes.CDLL:
    global _ACL_LIB
    if _ACL_LIB is None:
        # torch_npu has already loaded libascendcl.so; this finds that copy.
        lib = ctypes.CDLL("libascendcl.so", mode=ctypes.RTLD_GLOBAL)
        lib.aclrtHostRegister.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        lib.aclrtHostRegister.restype = ctypes.c_int
        lib.aclrtHostUnregister.argtypes = [ctypes.c_void_p]
        lib.aclrtHostUnregister.restype = ctypes.c_int
        _ACL_LIB = lib
    return _ACL_LIB


def _acl_host_register(ptr: int, nbytes: int) -> int:
    device_ptr = ctypes.c_void_p()
    return int(
        _acl().aclrtHostRegister(
            ctypes.c_void_p(ptr), nbytes, _ACL_HOST_REGISTER_MAPPED, ctypes.byref(device_ptr)
        )
    )


def _acl_host_unregister(ptr: int) -> int:
    return int(_acl().aclrtHostUnregister(ctypes.c_void_p(ptr)))
