"""libc calls the standard library does not expose (``mlock``, a mapping's address,
``sync_file_range``, ``memmove`` between raw addresses), through ctypes, which releases the GIL for
every foreign call: the stager, the restore and the writer copy while the event loop serves.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = [
    "buffer_address", "in_memory", "memmove", "mlock", "mlock_on_fault", "populate_write", "set_parent_death_signal",
    "start_writeback", "view_at", "zero"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _declare(name: str, *argtypes):
    """libc's ``name`` returning an int, None where this libc has none."""
    function = getattr(_libc, name, None)
    if function is not None:
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


_MLOCK = _declare("mlock", ctypes.c_void_p, ctypes.c_size_t)
_MLOCK2 = _declare("mlock2", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)  # glibc 2.27
_MLOCK_ONFAULT = 1
_MADVISE = _declare("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_FSTATFS = _declare("fstatfs", ctypes.c_int, ctypes.c_void_p)
_TMPFS_MAGIC = 0x01021994
_SYNC_FILE_RANGE = _declare("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)  # Linux
_PRCTL = getattr(_libc, "prctl", None)  # Linux; variadic: no argtypes
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait


def mlock(address: int, length: int) -> int:
    """mlock(2) (reads the pages in and pins them); 0 on success, else the errno."""
    return 0 if _MLOCK(address, length) == 0 else ctypes.get_errno()


def mlock_on_fault(address: int, length: int) -> int:
    """mlock2(MLOCK_ONFAULT): pin each page of the range as it is faulted in, from now on,
    without faulting any (a short hold of the process's memory map lock, where mlock walks and
    faults the whole range holding it); 0 on success, else the errno (ENOSYS where there is none)."""
    if _MLOCK2 is None:
        return 38  # ENOSYS
    return 0 if _MLOCK2(address, length, _MLOCK_ONFAULT) == 0 else ctypes.get_errno()


def populate_write(address: int, length: int) -> int:
    """madvise(MADV_POPULATE_WRITE): map every page of the range writable now; threads may
    populate disjoint ranges at once. 0 on success, else the errno (EINVAL before Linux 5.14)."""
    return 0 if _MADVISE(address, length, _MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()


def in_memory(fd: int) -> bool:
    """Whether ``fd``'s file is on tmpfs (``struct statfs`` starts with ``f_type``, a long)."""
    found = ctypes.create_string_buffer(256)  # larger than struct statfs on every Linux ABI
    return _FSTATFS(fd, found) == 0 and ctypes.c_long.from_buffer(found).value == _TMPFS_MAGIC


def set_parent_death_signal(signum: int) -> int:
    """prctl(PR_SET_PDEATHSIG): ``signum`` when the thread that started this process ends;
    0 on success, else the errno (not Linux: ENOSYS)."""
    if _PRCTL is None:
        return 38  # ENOSYS
    return 0 if _PRCTL(1, signum, 0, 0, 0) == 0 else ctypes.get_errno()  # 1: PR_SET_PDEATHSIG


def view_at(address: int, size: int) -> memoryview:
    """A byte view of ``size`` bytes at ``address`` (release it before unmapping)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def buffer_address(buffer) -> int:
    """Address of the first byte of a writable buffer (the temporary ctypes object holds its
    export only for this expression, so the mapping stays closable)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def memmove(destination: int, source: int, nbytes: int) -> None:
    """Copy ``nbytes`` between raw addresses with the GIL released."""
    ctypes.memmove(destination, source, nbytes)


def zero(destination: int, nbytes: int) -> None:
    """Zero ``nbytes`` at a raw address with the GIL released."""
    ctypes.memset(destination, 0, nbytes)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``[offset, offset + nbytes)`` to disk without waiting (a hint: durability
    comes from the caller's fsync, so a failure, or no such call, is ignored)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
