"""libc calls the standard library does not expose (``mlock``, a mapping's address,
``sync_file_range``, ``memmove`` between raw addresses), through ctypes, which releases the GIL for
every foreign call: the stager, the restore and the writer copy while the event loop serves.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = [
    "buffer_address", "bytes_address", "in_memory", "memmove", "mlock", "mlock_on_fault", "populate_write",
    "set_parent_death_signal", "start_writeback", "view_at", "zero"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mlock.restype = ctypes.c_int
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc.fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)
_libc.fstatfs.restype = ctypes.c_int
_TMPFS_MAGIC = 0x01021994

_SYNC_FILE_RANGE = getattr(_libc, "sync_file_range", None)  # Linux only
if _SYNC_FILE_RANGE is not None:
    _SYNC_FILE_RANGE.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    _SYNC_FILE_RANGE.restype = ctypes.c_int
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait


def mlock(address: int, length: int) -> int:
    """mlock(2) (reads the pages in and pins them); 0 on success, else the errno."""
    return 0 if _libc.mlock(address, length) == 0 else ctypes.get_errno()


_MLOCK2 = getattr(_libc, "mlock2", None)  # glibc 2.27
if _MLOCK2 is not None:
    _MLOCK2.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _MLOCK2.restype = ctypes.c_int
_MLOCK_ONFAULT = 1


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
    return 0 if _libc.madvise(address, length, _MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()


def in_memory(fd: int) -> bool:
    """Whether ``fd``'s file is on tmpfs (``struct statfs`` starts with ``f_type``, a long)."""
    found = ctypes.create_string_buffer(256)  # larger than struct statfs on every Linux ABI
    return _libc.fstatfs(fd, found) == 0 and ctypes.c_long.from_buffer(found).value == _TMPFS_MAGIC


def set_parent_death_signal(signum: int) -> int:
    """prctl(PR_SET_PDEATHSIG): ``signum`` when the thread that started this process ends;
    0 on success, else the errno (not Linux: ENOSYS)."""
    try:
        prctl = _libc.prctl
    except AttributeError:
        return 38  # ENOSYS
    return 0 if prctl(1, signum, 0, 0, 0) == 0 else ctypes.get_errno()  # 1: PR_SET_PDEATHSIG


def view_at(address: int, size: int) -> memoryview:
    """A byte view of ``size`` bytes at ``address`` (release it before unmapping)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def buffer_address(buffer) -> int:
    """Address of the first byte of a writable buffer (the temporary ctypes object holds its
    export only for this expression, so the mapping stays closable)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def bytes_address(data: bytes) -> int:
    """Address of a bytes object's first byte (valid while ``data`` lives; never written)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


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
