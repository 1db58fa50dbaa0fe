"""The arena: the host budget and the shared-memory segment files.

One segment file per session, under the server's shm directory, named only from the server's
own ids (``swap-state.<tag>.<session id>.<seq>``), mode 0600 (0660 with a group). A segment is
committed and pre-faulted when it is created (``posix_fallocate``), so a full tmpfs fails the
allocation with RESOURCE_EXHAUSTED instead of a SIGBUS in the trainer mid-step; then mlock'd
best effort. The server maps every segment itself (``Segment.buffer``), so snapshot code can
read it without another mapping.

Budget: ``total`` is ``--shm-size``. The copy-before-write pool (``--cow-budget``, whole slots
of ``chunk_bytes``) is held back from it; each segment takes its slots out of that pool, and
its header + tensors (+ page padding) out of the rest. So tensors can never eat the spare
slots snapshots rely on, and the sum of all segment files never exceeds ``total``.

Copy budget: a snapshot pauses nobody only when a segment's slots cover what the disk cannot
persist within one forward/backward (:class:`~swap_state.common.segment.CopyBudget`); a new
segment that falls short is logged (``copy_budget_short``, with the numbers), using
``persist_estimate`` (asked of the snapshot coordinator at need: its measured rate, capped by
``--persist-max-bandwidth``; the assumed ``ASSUMED_PERSIST_BYTES_PER_S`` before any snapshot)
and ``assumed_fwd_bwd_s``.

Restore staging: :meth:`Arena.reserve_staging` takes bytes out of the free budget for the
duration of a restore (the verified bytes it holds before the segment changes), and gives
them back after; it refuses (False) when the free budget cannot hold them.

Blocking methods (``create_segment``, ``free``) are thread-safe and meant for a worker thread:
committing tens of GiB takes seconds and must not stall liveness streams.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import pathlib
import stat
import threading
from collections.abc import Iterator, Sequence

from swap_state.common.segment import (
    TensorSpec,
    PAGE_BYTES,
    CopyBudget,
    SegmentHeader,
    SegmentLayout,
    align_up,
    layout_hash,
    model_bytes,
    plan_segment,
    tensor_nbytes,
)

from swap_state.common.server_header import ServerHeader
from swap_state.common.sizes import format_size
from swap_state.common.errors import ResourceExhausted, StartupError, Unavailable
from swap_state.server import _posix
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.logs import log_event

__all__ = [
    "LOCAL_RANKS_HINT",
    "MEMORY_FILESYSTEMS",
    "SEGMENT_PREFIX",
    "Arena",
    "Segment",
    "check_shm_dir",
    "filesystem_type",
]

log = logging.getLogger("swap_state.server.arena")

SEGMENT_PREFIX = "swap-state"
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
# The cow pool is shared by the sessions of a host; a session takes at most
# pool / min(world_size, LOCAL_RANKS_HINT) slots so that a typical 8-rank host leaves slots for
# every rank, while a single-rank job gets the whole pool.
LOCAL_RANKS_HINT = 8
_ZERO_BLOCK = bytes(1 << 20)

_mlock = _posix.mlock  # a module name, so that tests can replace it


def filesystem_type(path: pathlib.Path) -> str | None:
    """The fs type of the mount holding ``path`` (from /proc/self/mountinfo), None if unknown."""
    try:
        lines = pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount_point = fields[4].encode().decode("unicode_escape")  # \040 for spaces etc.
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, right.split()[0]
    return best_type


def _docker_size(nbytes: int) -> str:
    """A size in the form docker's --shm-size takes, rounded up (``64g``, ``512m``)."""
    gib, mib = 1 << 30, 1 << 20
    if nbytes >= gib:
        return f"{-(-nbytes // gib)}g"
    return f"{-(-nbytes // mib)}m"


def check_shm_dir(shm_dir: pathlib.Path, shm_size: int) -> int:
    """Start-up check: a directory on a memory filesystem with room for the whole budget.

    Returns the bytes available. Raises :class:`StartupError` naming the Docker/compose knob:
    a too small /dev/shm is the usual cause (Docker's default is 64 MB), and we never fall back
    to disk-backed files.
    """
    if not shm_dir.is_dir():
        raise StartupError(f"--shm-dir {shm_dir} does not exist or is not a directory")
    fstype = filesystem_type(shm_dir)
    if fstype is not None and fstype not in MEMORY_FILESYSTEMS:
        raise StartupError(
            f"--shm-dir {shm_dir} is on a {fstype} filesystem, not tmpfs: segments there would be "
            "backed by disk. Use /dev/shm (or another tmpfs mount)."
        )
    if fstype is None:
        log_event(log, "shm_fs_unknown", logging.WARNING, shm_dir=shm_dir,
                  detail="cannot read /proc/self/mountinfo; assuming a memory filesystem")
    vfs = os.statvfs(shm_dir)
    available = vfs.f_bavail * vfs.f_frsize
    if available < shm_size:
        raise StartupError(
            f"{shm_dir} has {available} bytes ({format_size(available)}) available, less than "
            f"--shm-size {shm_size} bytes ({format_size(shm_size)}). Give the container a larger "
            f"shared-memory mount, e.g. `docker run --shm-size {_docker_size(shm_size)} ...` "
            "or `shm_size:` in the compose service (Kubernetes: a Memory emptyDir at /dev/shm with "
            "a sizeLimit), or lower --shm-size. The server never falls back to disk."
        )
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        raise StartupError(f"--shm-dir {shm_dir} is not writable by this user")
    return available


def _model_share(layout: SegmentLayout) -> str:
    """The over-budget message's clause on the model tensors, "" without: a whole-state
    snapshot's parameters can be much of a segment, and the trainer can leave them out."""
    nbytes = model_bytes(layout.tensors)
    if not nbytes:
        return ""
    return (
        f", of which {nbytes} bytes ({format_size(nbytes)}) are the model's parameters and "
        "buffers (whole-state snapshots; RemoteConfig.snapshot_model=False or "
        "swap_state_checkpoint='full' leaves them out),"
    )


class Segment:
    """One session's shared-memory file, mapped by the server.

    Attributes the snapshot/restore code and the servicer use: ``path``, ``size``, ``layout``
    (:class:`SegmentLayout`), ``layout_hash``, ``header`` (:class:`SegmentHeader`), ``buffer``
    (the server's writable ``mmap`` of the whole file), ``cow_slots``, ``locked``,
    ``model_bytes`` (the model tensors' part of the tensors, for stats and metrics).

    Hold :meth:`borrow` while reading or writing ``buffer`` from code that may outlive the
    session (a snapshot still persisting when the session is freed): the file is unmapped,
    unlinked and its bytes returned to the budget only after the last borrower is done.
    """

    def __init__(
        self,
        arena: Arena,
        name: str,
        path: pathlib.Path,
        layout: SegmentLayout,
        specs_hash: str,
        charge: int,
    ) -> None:
        self.name = name
        self.path = path
        self.layout = layout
        self.layout_hash = specs_hash
        self.size = layout.size
        self.cow_slots = layout.cow_slots
        self.model_bytes = model_bytes(layout.tensors)  # once: stats and scrapes read it often
        self.charge = charge  # bytes counted against the tensor part of the budget
        self.buffer: mmap.mmap | None = None
        self.header: SegmentHeader | None = None
        self.locked = False
        self._arena = arena
        self._refs = 0
        self._created = False
        self._freeing = False
        self._closed = False

    @property
    def freed(self) -> bool:
        """True once :meth:`Arena.free` was called (the bytes may still be borrowed)."""
        return self._freeing

    @contextlib.contextmanager
    def borrow(self) -> Iterator[mmap.mmap]:
        """Keep the mapping alive for the duration of the block; yields ``buffer``."""
        with self._arena._lock:
            if self._freeing or self.buffer is None:
                raise Unavailable(f"segment {self.name} was freed")
            self._refs += 1
        try:
            yield self.buffer
        finally:
            with self._arena._lock:
                self._refs -= 1
                close_now = self._refs == 0 and self._freeing
            if close_now:
                self._arena._destroy(self)

    def _unmap(self) -> None:
        if self.header is not None:
            self.header.release()
            self.header = None
        if self.buffer is not None:
            try:
                self.buffer.close()
            except BufferError:
                # Someone kept a memoryview without borrow(); the file is still unlinked and the
                # mapping goes when that view does. Worth a loud line, never a crash.
                log_event(log, "segment_unmap_deferred", logging.WARNING, segment=self.name)
            self.buffer = None


class Arena:
    """Budget accounting and segment files. Thread-safe; see the module docstring."""

    def __init__(
        self,
        *,
        shm_dir: pathlib.Path,
        total_bytes: int,
        cow_pool_bytes: int,
        chunk_bytes: int,
        tag: str,
        gid: int | None = None,
        mlock: bool = True,
        copy_policy: CopyBudgetPolicy | None = None,
    ) -> None:
        self.shm_dir = shm_dir
        self.total_bytes = total_bytes
        self.chunk_bytes = chunk_bytes
        self.cow_pool_slots = cow_pool_bytes // chunk_bytes
        self.cow_reserve_bytes = self.cow_pool_slots * chunk_bytes
        self.tag = tag
        self.gid = gid
        self.mlock_enabled = mlock
        # Counters for Stats/metrics (read without the lock; ints are atomic enough to read).
        self.allocations = 0
        self.allocation_failures = 0
        self.mlock_failures = 0
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._tensor_used = 0
        self._cow_used_slots = 0
        self._cow_used_bytes = 0
        self._seq = 0
        self._closed = False
        self._warned_mlock = False
        self._staging_used = 0
        self.copy_policy = copy_policy or CopyBudgetPolicy()
        """The server's memory-rule inputs (shared with its snapshot coordinator)."""

    # ------------------------------------------------------------------ accounting
    @property
    def prefix(self) -> str:
        return f"{SEGMENT_PREFIX}.{self.tag}."

    @property
    def used_bytes(self) -> int:
        """Bytes of all live segment files (tensors, headers, padding and their cow slots)."""
        with self._lock:
            return self._tensor_used + self._cow_used_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes a new segment's header and tensors may still take (cow pool held back)."""
        with self._lock:
            return self.total_bytes - self.cow_reserve_bytes - self._tensor_used - self._staging_used

    @property
    def staging_bytes(self) -> int:
        """Bytes restores hold right now (see :meth:`reserve_staging`)."""
        return self._staging_used

    @contextlib.contextmanager
    def reserve_staging(self, nbytes: int) -> Iterator[bool]:
        """Hold ``nbytes`` of the free budget for the block (a restore's staged bytes); yields
        False, holding nothing, when they are not free."""
        with self._lock:
            free = self.total_bytes - self.cow_reserve_bytes - self._tensor_used - self._staging_used
            granted = 0 <= nbytes <= free
            if granted:
                self._staging_used += nbytes
        try:
            yield granted
        finally:
            if granted:
                with self._lock:
                    self._staging_used -= nbytes

    @property
    def persist_estimate(self) -> tuple[float, bool]:
        """(bytes/s, measured) the copy-budget warning uses now; set to fix one."""
        return self.copy_policy.rate()

    @persist_estimate.setter
    def persist_estimate(self, value: tuple[float, bool]) -> None:
        self.copy_policy.fix(value)

    @property
    def assumed_fwd_bwd_s(self) -> float:
        return self.copy_policy.fwd_bwd_s

    def copy_budget(self, layout: SegmentLayout) -> CopyBudget:
        """The memory rule for a segment of ``layout`` (the policy's)."""
        return self.copy_policy.budget(layout)

    @property
    def cow_slots_used(self) -> int:
        return self._cow_used_slots

    @property
    def segments(self) -> list[Segment]:
        with self._lock:
            return list(self._segments.values())

    def segment_chunk_bytes(self, specs: Sequence[TensorSpec]) -> int:
        """``--chunk-bytes``, or less for a segment whose largest tensor is smaller: its chunks
        (and so its cow slots, which hold one chunk each) never need more than that tensor,
        page aligned. A small model's segment then carries small spare slots; each still
        counts as one slot of the pool, so the pool is never over-committed."""
        largest = max((tensor_nbytes(dtype, shape) for _, dtype, shape in specs), default=0)
        return max(PAGE_BYTES, min(self.chunk_bytes, align_up(largest)))

    def cow_share(self, world_size: int) -> int:
        """Most cow slots one session of a job with ``world_size`` ranks on this server (its
        local world size) may take."""
        if self.cow_pool_slots == 0:
            return 0
        return max(1, self.cow_pool_slots // min(max(world_size, 1), LOCAL_RANKS_HINT))

    # ------------------------------------------------------------------ segments
    def create_segment(
        self,
        owner: str,
        specs: Sequence[TensorSpec],
        world_size: int,
        *,
        specs_hash: str | None = None,
    ) -> Segment:
        """Plan, charge, create, pre-fault, map and initialise a segment (blocking).

        ``owner`` is a server-issued id (hex), part of the file name. ``specs_hash``: the
        caller's ``layout_hash(specs)`` when it has one (O(tensors) to compute again).
        """
        if not owner.isalnum():
            raise ValueError("segment owner must be a server-issued alphanumeric id")
        chunk = self.segment_chunk_bytes(specs)
        n_chunks = sum(-(-tensor_nbytes(dtype, shape) // chunk) for _, dtype, shape in specs)
        want = min(self.cow_share(world_size), n_chunks)
        layout = plan_segment(specs, chunk, want)
        with self._lock:
            if self._closed:
                raise Unavailable("the server is shutting down")
            slots = min(want, self.cow_pool_slots - self._cow_used_slots)
            if slots != layout.cow_slots:
                layout = plan_segment(specs, chunk, slots)
            charge = layout.cow_slots_offset  # header + tensors + page padding
            free = self.total_bytes - self.cow_reserve_bytes - self._tensor_used - self._staging_used
            if charge > free:
                self.allocation_failures += 1
                raise ResourceExhausted(
                    f"segment for {len(specs)} tensors needs {charge} bytes "
                    f"({format_size(charge)}, header and page padding included)"
                    f"{_model_share(layout)} but only {free} "
                    f"bytes ({format_size(free)}) are free of {self.total_bytes} bytes total "
                    f"(--shm-size {format_size(self.total_bytes)}; {self._tensor_used} bytes in "
                    f"{len(self._segments)} segments, {self.cow_reserve_bytes} bytes held for the "
                    "copy-before-write pool): requested "
                    f"{charge}, free {free}, total {self.total_bytes}"
                )
            self._tensor_used += charge
            self._cow_used_slots += layout.cow_slots
            self._cow_used_bytes += layout.cow_slots * layout.chunk_bytes
            self._seq += 1
            name = f"{self.prefix}{owner}.{self._seq}"
        path = self.shm_dir / name
        digest = specs_hash if specs_hash is not None else layout_hash(specs)
        segment = Segment(self, name, path, layout, digest, charge)
        try:
            self._materialize(segment)
        except BaseException:
            self._release_charge(segment)
            segment._unmap()
            if segment._created:  # never unlink a file this call did not create
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            with self._lock:
                self.allocation_failures += 1
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._segments[name] = segment
                self.allocations += 1
        if closed:  # shut down while we were faulting pages in
            self._destroy(segment)
            raise Unavailable("the server is shutting down")
        budget = self.copy_budget(layout)
        if budget.short_bytes:
            log_event(
                log, "copy_budget_short", logging.WARNING, segment=name,
                state_bytes=budget.state_bytes, slot_bytes=budget.slot_bytes,
                needed_bytes=budget.needed_bytes, persist_bytes_per_s=int(budget.persist_bytes_per_s),
                persist_measured=budget.persist_measured, assumed_fwd_bwd_s=budget.fwd_bwd_s,
                cow_pool_slots=self.cow_pool_slots, detail=budget.warning(),
            )
        return segment

    def _materialize(self, segment: Segment) -> None:
        # O_EXCL|O_NOFOLLOW: never reuse or follow something another process put there.
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(segment.path, flags, 0o600)
        segment._created = True
        try:
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
            os.fchmod(fd, 0o660 if self.gid is not None else 0o600)  # umask-independent
            self._commit(fd, segment)
            segment.buffer = mmap.mmap(fd, segment.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        header = SegmentHeader(segment.buffer, segment.layout.n_chunks, segment.layout.cow_slots)
        ServerHeader(header).initialize(segment.layout)
        segment.header = header
        if self.mlock_enabled:
            self._lock_pages(segment)

    def _commit(self, fd: int, segment: Segment) -> None:
        """Allocate every page of the file now, so a full tmpfs fails here, not with SIGBUS."""
        try:
            os.posix_fallocate(fd, 0, segment.size)
            return
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise self._shm_full(segment) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        # Filesystems without fallocate: write zeros, which allocates just the same.
        try:
            offset = 0
            while offset < segment.size:
                length = min(len(_ZERO_BLOCK), segment.size - offset)
                offset += os.pwrite(fd, _ZERO_BLOCK[:length], offset)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise self._shm_full(segment) from None
            raise

    def _shm_full(self, segment: Segment) -> ResourceExhausted:
        vfs = os.statvfs(self.shm_dir)
        available = vfs.f_bavail * vfs.f_frsize
        log_event(log, "shm_full", logging.ERROR, shm_dir=self.shm_dir, requested=segment.size,
                  available=available)
        return ResourceExhausted(
            f"{self.shm_dir} is full: could not commit {segment.size} bytes for a segment "
            f"({available} bytes available on the filesystem, although the --shm-size budget "
            "allowed it: something else uses that tmpfs). Raise `docker run --shm-size` / "
            f"compose `shm_size`, or free {self.shm_dir}: requested {segment.size}, "
            f"free {available}, total {self.total_bytes}"
        )

    def _lock_pages(self, segment: Segment) -> None:
        assert segment.buffer is not None
        err = _mlock(_posix.buffer_address(segment.buffer), segment.size)
        if err == 0:
            segment.locked = True
            return
        with self._lock:
            self.mlock_failures += 1
            first = not self._warned_mlock
            self._warned_mlock = True
        # Once per server: pages of an unlocked segment may be swapped out, which makes the
        # trainer's step slower, but it is not an error.
        log_event(
            log,
            "mlock_refused",
            logging.WARNING if first else logging.DEBUG,
            segment=segment.name,
            bytes=segment.size,
            errno=errno.errorcode.get(err, str(err)),
            hint="raise RLIMIT_MEMLOCK (ulimit -l unlimited; docker --ulimit memlock=-1) or grant "
            "CAP_IPC_LOCK; segments stay usable but may be swapped",
        )

    def _release_charge(self, segment: Segment) -> None:
        with self._lock:
            self._tensor_used -= segment.charge
            self._cow_used_slots -= segment.cow_slots
            self._cow_used_bytes -= segment.cow_slots * segment.layout.chunk_bytes

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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path)
        self._release_charge(segment)

    def close(self) -> None:
        """Free every segment (server shutdown); later creations fail with UNAVAILABLE."""
        with self._lock:
            self._closed = True
            segments = list(self._segments.values())
        for segment in segments:
            self.free(segment)

    def remove_leftovers(self) -> tuple[int, int]:
        """Unlink segment files a dead server with the same tag left behind (SIGKILL, OOM).

        Only called once the caller knows no live server uses this tag (it holds the socket
        lock or bound the same TCP port). Returns (files, bytes) removed.
        """
        removed = removed_bytes = 0
        uid = os.geteuid()
        for entry in os.scandir(self.shm_dir):
            if not entry.name.startswith(self.prefix):
                continue
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
                removed_bytes += info.st_blocks * 512
        return removed, removed_bytes
