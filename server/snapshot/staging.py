"""Restore's staging: the source tensors a plan reads, each verified (crc32) and held unchanged
until the caller has copied them into the segment (:func:`staged_tensors`).

A tier whose files are on this host's filesystem (``--snapshot-dir``, a directory store) has its
data files mapped read only: a reader thread reads the tensors in and pins them (``mlock``),
region by region in file order, while this thread checksums each one. The bytes are read once,
into the page cache, never into fresh memory, which faults in at about the disk's rate on the
2-core VM (docs/benchmarks.md). Any other tier (an object store), and a tensor some of whose
pages ``mlock`` refused, is read into memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from swap_state.common.checksum import crc32
from swap_state.common.snapshot_errors import SnapshotCorrupt, SnapshotError
from swap_state.common.snapshot_format import RankManifest, TensorRecord
from swap_state.common.snapshot_reader import SnapshotInfo, SnapshotTier, reading_file
from swap_state.server import _posix
from swap_state.server.logs import log_event

__all__ = ["staged_tensors"]

log = logging.getLogger("swap_state.server.restore")

STAGE_REGION_BYTES = 16 << 20
"""The reader thread pins the tensors in regions of this size (mlock's faults read ahead; a
``posix_fadvise(WILLNEED)`` ahead of them made pinning 256 MiB 1.7x slower on the 2-core VM:
0.12-0.18 s against 0.07 s)."""

_mlock = _posix.mlock  # a module name, so that tests can replace it

Wanted = Mapping[int, tuple[RankManifest, Sequence[TensorRecord]]]
"""Per source rank: its manifest and the tensors read from its data file."""


@contextlib.contextmanager
def staged_tensors(tier: SnapshotTier, info: SnapshotInfo, wanted: Wanted,
                   each: Callable[[tuple[int, str], int], None] | None = None) -> Iterator[dict[tuple[int, str], int]]:
    """Stage and verify every tensor of ``wanted`` (each data file's header checked before:
    :meth:`~SnapshotTier.check_data_header`); yields the address of each one's bytes by (source
    rank, tensor name), valid and unchanging until the block ends. ``each(key, address)`` runs
    as soon as one is verified, while the next ones are read. SnapshotCorrupt names the file and
    the tensor."""
    addresses: dict[tuple[int, str], int] = {}
    held: list[bytes] = []
    with contextlib.ExitStack() as stack:
        for rank, (manifest, tensors) in wanted.items():
            path = tier.local_file(info, manifest.data_file)
            pinned = stack.enter_context(PinnedFile(path, manifest, tensors)) if path is not None else None
            for tensor in tensors:
                address = pinned.verified(tensor) if pinned is not None else None
                if address is None:  # not on this host's filesystem, or not pinned
                    data = tier.read_tensor(info, manifest, tensor)
                    held.append(data if type(data) is bytes else bytes(data))
                    address = _posix.bytes_address(held[-1])
                addresses[rank, tensor.name] = address
                if each is not None:
                    each((rank, tensor.name), address)
        yield addresses


class PinnedFile:
    """A rank's data file mapped read only; a reader thread pins the pages of the given tensors,
    in file order, while the caller checks each one (:meth:`verified`)."""

    def __init__(self, path: pathlib.Path, manifest: RankManifest, tensors: Sequence[TensorRecord]):
        self.path = path
        self._tensors = sorted(tensors, key=lambda t: t.data_offsets[0])
        self._start = manifest.data_start
        with reading_file(path):
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(self._fd).st_size
            if self.size != manifest.data_file_bytes:
                raise SnapshotCorrupt(f"{path} changed while being restored: restore again")
            try:
                self.address = _posix.mmap_read_only(self._fd, self.size) if self.size else 0
            except OSError as exc:
                raise SnapshotError(f"cannot map {path}: {exc}") from None
        except BaseException:
            os.close(self._fd)
            raise
        self._pinned: dict[str, int] = {}  # tensor name -> mlock's errno (0: pinned)
        self._warned = False
        self._ready: queue.Queue[tuple[str, int] | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="restore-stage", daemon=True)
        self._thread.start()

    def __enter__(self) -> PinnedFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        if self.size:
            _posix.munmap(self.address, self.size)  # also unpins
        os.close(self._fd)

    def _run(self) -> None:
        try:
            for tensor in self._tensors:
                start, failed = self._start + tensor.data_offsets[0], 0
                for offset in range(0, tensor.nbytes, STAGE_REGION_BYTES):
                    if self._stop.is_set():
                        return
                    length = min(STAGE_REGION_BYTES, tensor.nbytes - offset)
                    failed = failed or _mlock(self.address + start + offset, length)  # reads it in, pins it
                if tensor.nbytes:
                    self._ready.put((tensor.name, failed))
        except BaseException as exc:  # reported by verified()
            self._ready.put(exc)

    def verified(self, tensor: TensorRecord) -> int | None:
        """The address of ``tensor``'s bytes once pinned and checked against its crc32; None when
        ``mlock`` refused some of its pages (the caller reads it instead)."""
        address = self.address + self._start + tensor.data_offsets[0]
        if tensor.nbytes:
            while tensor.name not in self._pinned:
                item = self._ready.get()
                if isinstance(item, BaseException):
                    raise item
                self._pinned[item[0]] = item[1]
            if self._pinned[tensor.name]:
                if not self._warned:
                    self._warned = True
                    log_event(log, "restore_unpinned", logging.WARNING, path=str(self.path),
                              errno=self._pinned[tensor.name], detail="mlock refused (RLIMIT_MEMLOCK?): "
                              "the tensors it could not pin are read into memory instead")
                return None
            with _posix.view_at(address, tensor.nbytes) as view:
                value = crc32(view)
        else:
            value = 0
        if value != tensor.crc32:
            raise SnapshotCorrupt(f"{self.path}: tensor {tensor.name!r} fails its checksum "
                                  f"(crc32 {value:08x}, manifest says {tensor.crc32:08x})")
        return address
