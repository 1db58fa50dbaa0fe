"""The arena: the host budget (``--shm-size``, the ``--cow-budget`` pool of copy slots held back from
it so tensors never eat the slots snapshots rely on) and the shared-memory segment files
(:class:`Segment`), committed with ``posix_fallocate`` when created (a full tmpfs fails with
RESOURCE_EXHAUSTED, never a SIGBUS in the trainer mid-step), then mlock'd best effort. Blocking
methods are thread-safe and meant for a worker thread (committing tens of GiB takes seconds). Call order::

    segment = arena.create_segment(...)       # file committed, mapped, header initialised
    with segment.borrow() as buffer: ...      # read or write the mapping (snapshot, restore)
    arena.free(segment)                       # unmapped and unlinked once the last borrow ends
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import mmap
import os
import pathlib
import threading
from collections.abc import Callable, Iterator, Sequence

from swap_state.common.segment import (
    TensorSpec, PAGE_BYTES, SegmentHeader, SegmentLayout, align_up,
    model_bytes, plan_segment, segment_file_bytes, tensor_nbytes)
from swap_state.common.segment_descriptor import SegmentDescriptor

from swap_state.common.server_header import ServerHeader
from swap_state.common.sizes import format_size
from swap_state.common.errors import BudgetExhaustedError, ServerUnavailableError
from swap_state.server import _posix
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.logs import log_event
from swap_state.server.tenants import tenant_uid

__all__ = ["LOCAL_RANKS_HINT", "SEGMENT_PREFIX", "Arena", "Segment"]

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "swap-state"
# The cow pool is shared by the sessions of a host; a session takes at most pool / min(world_size, LOCAL_RANKS_HINT)
# slots so that a typical 8-rank host leaves slots for every rank, while a single-rank job gets the whole pool.
LOCAL_RANKS_HINT = 8
_ZERO_BLOCK = bytes(1 << 20)
_POPULATE_CHUNK = 256 << 20
_POPULATE_THREADS = min(8, len(os.sched_getaffinity(0)))
# One pool for every allocation of the server: the ranks of a host allocate at once, and their
# faults on threads beyond the CPUs only contend (measured: docs/benchmarks.md).
_POPULATE_POOL = concurrent.futures.ThreadPoolExecutor(_POPULATE_THREADS, thread_name_prefix="swap-state-populate")

_mlock = _posix.mlock  # module names, so that tests can replace them
_mlock_on_fault = _posix.mlock_on_fault


def _tensor_charge(layout: SegmentLayout, descriptor_bytes: int) -> int:
    """What a segment takes of the budget besides its copy slots (which the pool holds)."""
    return segment_file_bytes(layout, descriptor_bytes) - layout.cow_slots * layout.chunk_bytes


def _model_share(layout: SegmentLayout) -> str:
    """The over-budget message's clause on the model tensors ("" without any)."""
    nbytes = model_bytes(layout.tensors)
    if not nbytes:
        return ""
    return (f", of which {nbytes} bytes ({format_size(nbytes)}) are the model's parameters and buffers (whole-state "
            "snapshots; RemoteConfig.snapshot_model=False or swap_state_checkpoint='full' leaves them out),")


class Segment:
    """One session's shared-memory file, mapped by the server (``buffer``). Hold :meth:`borrow` while
    using ``buffer`` from code that may outlive the session: unmapped after the last borrower."""

    def __init__(self, name: str, path: pathlib.Path, layout: SegmentLayout, specs_hash: str, *, lock: threading.Lock,
                 destroy: Callable[[Segment], None], descriptor_bytes: int = 0) -> None:
        """``destroy`` runs when the last borrower of a freed segment is done; ``descriptor_bytes``:
        the encoded descriptor's length after the copy slots."""
        self.name, self.path, self.layout, self.layout_hash = name, path, layout, specs_hash
        self.size = layout.size  # bytes mapped (the layout; the trainer maps as many)
        self.descriptor_bytes = descriptor_bytes
        self.file_bytes = segment_file_bytes(layout, descriptor_bytes)  # the layout, then the descriptor's pages
        self.keep_file = False  # set at shutdown when the file stays for the next server to adopt
        self.tenant = ""  # whose quota (--tenant-shm-quota) it is charged to
        self.cow_slots = layout.cow_slots
        self.model_bytes = model_bytes(layout.tensors)  # once: stats and scrapes read it often
        self.charge = _tensor_charge(layout, descriptor_bytes)  # what it takes of the tensor budget
        self.buffer: mmap.mmap | None = None
        self.header: SegmentHeader | None = None
        self.locked = False
        self._lock, self._destroy = lock, destroy
        self._refs = 0
        self._created = self._freeing = self._closed = False

    @property
    def freed(self) -> bool:
        """True once :meth:`Arena.free` was called (the bytes may still be borrowed)."""
        return self._freeing

    @contextlib.contextmanager
    def borrow(self) -> Iterator[mmap.mmap]:
        """Keep the mapping alive for the duration of the block; yields ``buffer``."""
        with self._lock:
            if self._freeing or self.buffer is None:
                raise ServerUnavailableError(f"segment {self.name} was freed")
            self._refs += 1
        try:
            yield self.buffer
        finally:
            with self._lock:
                self._refs -= 1
                close_now = self._refs == 0 and self._freeing
            if close_now:
                self._destroy(self)

    def _unmap(self) -> None:
        if self.header is not None:
            self.header.release()
            self.header = None
        if self.buffer is not None:
            try:
                self.buffer.close()
            except BufferError:
                # A memoryview kept without borrow(): the mapping goes when it does. Never a crash.
                log_event(log, "segment_unmap_deferred", logging.WARNING, segment=self.name)
            self.buffer = None


class Arena:
    """Budget accounting and segment files. Thread-safe."""

    def __init__(self, *, shm_dir: pathlib.Path, total_bytes: int, cow_pool_bytes: int, chunk_bytes: int, tag: str,
                 gid: int | None = None, mlock: bool = True, copy_policy: CopyBudgetPolicy | None = None,
                 tenant_quota: int = 0) -> None:
        self.shm_dir = shm_dir
        self.tenant_quota = tenant_quota  # bytes of segments one tenant may hold (0: no quota)
        self._tenant_used: dict[str, int] = {}
        self.total_bytes, self.chunk_bytes = total_bytes, chunk_bytes
        self.cow_pool_slots = cow_pool_bytes // chunk_bytes
        self.cow_reserve_bytes = self.cow_pool_slots * chunk_bytes
        self.tag, self.gid, self.mlock_enabled = tag, gid, mlock
        # Counters and gauges for Stats/metrics, written under the lock, read without it (ints are
        # atomic enough to read): the pool's slots (and their bytes) in live segment files (part of
        # ``used_bytes``), and the bytes restores hold right now (:meth:`reserve_staging`).
        self.allocations = self.allocation_failures = self.mlock_failures = 0
        self.cow_slots_used = self.cow_used_bytes = self.staging_bytes = 0
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._tensor_used = self._seq = 0
        self._closed = self._warned_mlock = False
        self.copy_policy = copy_policy or CopyBudgetPolicy()  # shared with the snapshot coordinator

    @property
    def prefix(self) -> str:
        return f"{SEGMENT_PREFIX}.{self.tag}."

    @property
    def used_bytes(self) -> int:
        """Bytes of all live segment files (tensors, headers, padding and their cow slots)."""
        with self._lock:
            return self._tensor_used + self.cow_used_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes a new segment's header and tensors may still take (cow pool held back)."""
        with self._lock:
            return self._free()

    def _free(self) -> int:  # under the lock
        return self.total_bytes - self.cow_reserve_bytes - self._tensor_used - self.staging_bytes

    @contextlib.contextmanager
    def reserve_staging(self, nbytes: int) -> Iterator[bool]:
        """Hold ``nbytes`` of the free budget for the block (a restore's staged bytes); yields
        False, holding nothing, when they are not free."""
        with self._lock:
            granted = 0 <= nbytes <= self._free()
            if granted:
                self.staging_bytes += nbytes
        try:
            yield granted
        finally:
            if granted:
                with self._lock:
                    self.staging_bytes -= nbytes

    @property
    def segments(self) -> list[Segment]:
        with self._lock:
            return list(self._segments.values())

    def cow_share(self, world_size: int) -> int:
        """Most cow slots one session of a job with ``world_size`` ranks on this server may take."""
        if self.cow_pool_slots == 0:
            return 0
        return max(1, self.cow_pool_slots // min(max(world_size, 1), LOCAL_RANKS_HINT))

    def create_segment(self, owner: str, descriptor: SegmentDescriptor) -> Segment:
        """Plan, charge (to its tenant's quota), create, pre-fault, map and initialise the segment of
        ``descriptor``'s tensors (blocking). ``owner``: a server-issued hex id, part of the file
        name. The descriptor, what a successor server needs to adopt it, goes after the copy slots."""
        if not owner.isalnum():
            raise ValueError("segment owner must be a server-issued alphanumeric id")
        raw = descriptor.encode()
        name, layout = self._charge(owner, descriptor.tensors, descriptor.local_world_size, len(raw), descriptor.tenant)
        segment = self.segment_object(name, layout, descriptor.layout_hash, len(raw))
        segment.tenant = descriptor.tenant
        try:
            self._materialize(segment, raw)
        except BaseException:  # give the charge back and remove what this call created
            self._release_charge(segment)
            segment._unmap()
            if segment._created:  # never unlink a file this call did not create
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment.path)
            with self._lock:
                self.allocation_failures += 1
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._segments[segment.name] = segment
                self.allocations += 1
        if closed:  # shut down while we were faulting pages in
            self._destroy(segment)
            raise ServerUnavailableError("the server is shutting down")
        if (short := self.copy_policy.shortfall(segment.layout)) is not None:
            log_event(log, "copy_budget_short", logging.WARNING, segment=segment.name,
                      cow_pool_slots=self.cow_pool_slots, **short)
        return segment

    def segment_object(self, name: str, layout: SegmentLayout, digest: str, descriptor_bytes: int) -> Segment:
        """The :class:`Segment` of file ``name``, freed through this arena (not mapped or charged)."""
        return Segment(name, self.shm_dir / name, layout, digest, lock=self._lock, destroy=self._destroy,
                       descriptor_bytes=descriptor_bytes)

    def _charge(self, owner: str, specs: Sequence[TensorSpec], world_size: int, descriptor_bytes: int,
                tenant: str) -> tuple[str, SegmentLayout]:
        """Plan and charge the segment and name its file: (name, layout). BudgetExhaustedError
        when the free budget, or ``tenant``'s quota, cannot hold it."""
        # --chunk-bytes, or the largest tensor page aligned when smaller (a small model's slots
        # are small; each still counts as one slot of the pool).
        largest = max((tensor_nbytes(dtype, shape) for _, dtype, shape in specs), default=0)
        chunk = max(PAGE_BYTES, min(self.chunk_bytes, align_up(largest)))
        n_chunks = sum(-(-tensor_nbytes(dtype, shape) // chunk) for _, dtype, shape in specs)
        want = min(self.cow_share(world_size), n_chunks)
        layout = plan_segment(specs, chunk, want)  # planned outside the lock: O(tensors)
        with self._lock:
            if self._closed:
                raise ServerUnavailableError("the server is shutting down")
            slots = min(want, self.cow_pool_slots - self.cow_slots_used)
            if slots != layout.cow_slots:
                layout = plan_segment(specs, chunk, slots)
            charge = _tensor_charge(layout, descriptor_bytes)
            free = self._free()
            if charge > free:
                self.allocation_failures += 1
                raise BudgetExhaustedError(
                    f"segment for {len(specs)} tensors needs {charge} bytes ({format_size(charge)}, header and page "
                    f"padding included){_model_share(layout)} but only {free} bytes ({format_size(free)}) are free of "
                    f"{self.total_bytes} bytes total (--shm-size {format_size(self.total_bytes)}; {self._tensor_used} "
                    f"bytes in {len(self._segments)} segments, {self.cow_reserve_bytes} bytes held for the "
                    f"copy-before-write pool): requested {charge}, free {free}, total {self.total_bytes}")
            held = self._tenant_used.get(tenant, 0)
            if self.tenant_quota and held + charge > self.tenant_quota:
                self.allocation_failures += 1
                raise BudgetExhaustedError(
                    f"segment of {format_size(charge)} refused: this tenant holds {format_size(held)} "
                    f"of its --tenant-shm-quota {format_size(self.tenant_quota)} on this server; free a "
                    "session of it (Detach) or ask for a larger quota (other tenants are unaffected)")
            self._account(tenant, charge, layout, 1)
            self._seq += 1
            return f"{self.prefix}{owner}.{self._seq}", layout

    def _account(self, tenant: str, charge: int, layout: SegmentLayout, sign: int) -> None:
        """Add (``sign`` 1) or take back (-1) a segment's bytes and slots; under the lock."""
        self._tenant_used[tenant] = self._tenant_used.get(tenant, 0) + sign * charge
        self._tensor_used += sign * charge
        self.cow_slots_used += sign * layout.cow_slots
        self.cow_used_bytes += sign * layout.cow_slots * layout.chunk_bytes

    def _materialize(self, segment: Segment, descriptor: bytes) -> None:
        # O_EXCL|O_NOFOLLOW: never reuse or follow something another process put there.
        fd = os.open(segment.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        segment._created = True
        try:
            owner = tenant_uid(segment.tenant) if os.geteuid() == 0 else None
            if owner:  # a root daemon: the tenant's file, 0600, none of another tenant's business
                os.fchown(fd, owner, -1)
            elif self.gid is not None:
                os.fchown(fd, -1, self.gid)
            os.fchmod(fd, 0o660 if self.gid is not None and not owner else 0o600)  # umask-independent
            self._commit(fd, segment)
            os.pwrite(fd, descriptor, segment.layout.size)  # before MAGIC (initialize)
            segment.buffer = mmap.mmap(fd, segment.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        header = SegmentHeader(segment.buffer, segment.layout.n_chunks, segment.layout.cow_slots)
        ServerHeader(header).initialize(segment.layout, segment.layout_hash, segment.descriptor_bytes)
        segment.header = header
        if self.mlock_enabled:
            self._lock_pages(segment)

    def _commit(self, fd: int, segment: Segment) -> None:
        """Allocate every page of the file now, so a full tmpfs fails here, not with SIGBUS."""
        try:
            try:
                os.posix_fallocate(fd, 0, segment.file_bytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                # Filesystems without fallocate: write zeros, which allocates just the same.
                offset = 0
                while offset < segment.file_bytes:
                    offset += os.pwrite(fd, _ZERO_BLOCK[:segment.file_bytes - offset], offset)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            vfs = os.statvfs(self.shm_dir)
            available = vfs.f_bavail * vfs.f_frsize
            log_event(log, "shm_full", logging.ERROR, shm_dir=self.shm_dir, requested=segment.size, available=available)
            raise BudgetExhaustedError(
                f"{self.shm_dir} is full: could not commit {segment.size} bytes for a segment ({available} bytes "
                "available on the filesystem, although the --shm-size budget allowed it: something else uses that "
                f"tmpfs). Raise `docker run --shm-size` / compose `shm_size`, or free {self.shm_dir}: requested "
                f"{segment.size}, free {available}, total {self.total_bytes}") from None

    def _lock_pages(self, segment: Segment) -> None:
        assert segment.buffer is not None
        address = _posix.buffer_address(segment.buffer)
        # Pinned as the populate faults them: mlock's own walk afterwards held the process's memory
        # map lock for writing, stalling the faults of the other ranks allocating at once.
        err = _mlock_on_fault(address, segment.size)
        # The pages faulted in on the shared threads (mlock faults on one: docs/benchmarks.md); best effort:
        # without MADV_POPULATE_WRITE mlock does it.
        list(_POPULATE_POOL.map(lambda at: _posix.populate_write(address + at, min(_POPULATE_CHUNK, segment.size - at)),
                                range(0, segment.size, _POPULATE_CHUNK)))
        if err in (errno.ENOSYS, errno.EINVAL):  # no mlock2 (an old kernel or libc): lock the faulted pages
            err = _mlock(address, segment.size)
        if err == 0:
            segment.locked = True
            return
        with self._lock:
            self.mlock_failures += 1
            first = not self._warned_mlock
            self._warned_mlock = True
        # Once per server: an unlocked segment may be swapped (slower steps), not an error.
        log_event(log, "mlock_refused", logging.WARNING if first else logging.DEBUG, segment=segment.name,
                  bytes=segment.size, errno=errno.errorcode.get(err, str(err)),
                  hint="raise RLIMIT_MEMLOCK (ulimit -l unlimited; docker --ulimit memlock=-1) or grant "
                  "CAP_IPC_LOCK; segments stay usable but may be swapped")

    def _release_charge(self, segment: Segment) -> None:
        with self._lock:
            self._account(segment.tenant, segment.charge, segment.layout, -1)

    def free(self, segment: Segment) -> None:
        """Unmap, unlink and return the bytes; deferred while someone borrows the segment."""
        with self._lock:
            if segment._freeing:
                return
            segment._freeing = True
            busy = segment._refs > 0
        if not busy:
            self._destroy(segment)

    def _destroy(self, segment: Segment) -> None:
        with self._lock:
            if segment._closed:
                return
            segment._closed = True
            self._segments.pop(segment.name, None)
        segment._unmap()
        if not segment.keep_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)
        self._release_charge(segment)

    def close(self, keep: Sequence[Segment] = ()) -> None:
        """Unmap every segment (shutdown): the files of ``keep`` stay for the next server to
        adopt, the others are unlinked. Later creations fail with UNAVAILABLE."""
        with self._lock:
            self._closed = True
            segments = list(self._segments.values())
        for segment in keep:
            segment.keep_file = True
        for segment in segments:
            self.free(segment)

    def adopt(self, segment: Segment, seq: int) -> None:
        """Charge a segment a previous server left (checked by :mod:`.adopt`) like a created
        one; BudgetExhaustedError when this server's budget cannot hold it."""
        with self._lock:
            free = self._free()
            pool_free = self.cow_pool_slots - self.cow_slots_used
            if segment.charge > free or segment.cow_slots > pool_free:
                raise BudgetExhaustedError(f"it needs {segment.charge} bytes and {segment.cow_slots} copy slots, this "
                                        f"server has {free} bytes and {pool_free} slots free: start it with the "
                                        "--shm-size and --cow-budget of the one before")
            self._account(segment.tenant, segment.charge, segment.layout, 1)
            self._segments[segment.name] = segment
            self._seq = max(self._seq, seq)
        if self.mlock_enabled:
            self._lock_pages(segment)
