"""Maps a session's shared-memory segment into the trainer and exposes torch views on it
(writes are the server's memory: they survive a trainer crash).

Call order::

    mapping = SegmentMapping.open(segment_info)   # mmap + header check
    mapping.register_for_dma(backend)             # once; no-op on CPU
    views = mapping.tensor_views()                # name -> torch.Tensor on the mapping
    mapping.guard(max_wait_s, server_gone)        # copy-before-write from here on
    mapping.before_write(step, names); mapping.trainer.end_write()   # per step, the writing thread
    mapping.close()                               # unregister, unmap (views dropped first)
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable

import torch

from swap_state.common.dtypes import DTYPE_NAMES
from swap_state.proto import swap_state_pb2 as pb
from swap_state.common.copy_before_write import TrainerProtector
from swap_state.common.segment import SegmentHeader, SegmentLayout, TensorLayout, Word, chunk_table
from swap_state.common.trainer_header import TrainerHeader
from swap_state.common.trainer_presence import hold

__all__ = ["TORCH_DTYPES", "SegmentMapping"]

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise TypeError(f"dtype {dtype} cannot be kept by swap-state (supported: {list(TORCH_DTYPES)})")


class SegmentMapping:
    """A writable mapping of one segment file."""

    def __init__(self, info: pb.SegmentInfo, mm: mmap.mmap, fd: int = -1):
        """``fd``: the segment file, held open (and locked) while mapped; closed by :meth:`close`."""
        self.info = info
        self._mm = mm
        self._fd = fd
        self._base = torch.frombuffer(mm, dtype=torch.uint8)  # one export, all views derive
        self.header = SegmentHeader(mm)
        self.header.check()
        self.trainer = TrainerHeader(self.header)  # the trainer's only writes to the header
        self.tensors = tuple(TensorLayout(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in info.tensors)
        self.chunks = chunk_table(self.tensors, info.chunk_bytes)
        self._registered: tuple[object, int] | None = None
        self._protector: TrainerProtector | None = None
        self._index = {t.name: i for i, t in enumerate(self.tensors)}

    @classmethod
    def open(cls, info: pb.SegmentInfo) -> SegmentMapping:
        try:
            fd = os.open(info.path, os.O_RDWR)
        except OSError as e:
            raise RuntimeError(f"cannot open swap-state segment {info.path}: {e.strerror}; the trainer must "
                               "share /dev/shm with the server (docker: ipc: service:<server>; "
                               "kubernetes: the same pod or hostIPC)") from e
        try:
            size = os.fstat(fd).st_size
            if size < info.size:
                raise RuntimeError(f"swap-state segment {info.path} has {size} bytes, expected {info.size}")
            mm = mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED)
            hold(fd)  # while this process maps it: a restarted server knows its trainer is alive
        except BaseException:
            os.close(fd)
            raise
        return cls(info, mm, fd)

    @property
    def data_ptr(self) -> int:
        return self._base.data_ptr()

    def tensor_views(self) -> dict[str, torch.Tensor]:
        return {t.name: self._base[t.offset : t.offset + t.nbytes].view(TORCH_DTYPES[t.dtype]).view(t.shape)
                for t in self.tensors}

    def register_for_dma(self, backend) -> None:
        """Pin the whole mapping for device DMA once, in chunks that never split a tensor
        (``spans``); the copy slots (host-only) add ``cuts`` where a chunk may also end."""
        if self._registered is None and backend.is_accelerator:
            spans = [(t.offset, t.nbytes) for t in self.tensors]
            info = self.info
            cuts = [info.cow_slots_offset + i * info.chunk_bytes for i in range(info.cow_slots + 1)]
            backend.register_host_memory(self.data_ptr, info.size, cuts=cuts, spans=spans)
            self._registered = (backend, self.data_ptr)

    def guard(self, max_wait_s: float | None, server_gone: Callable[[], bool] | None = None) -> None:
        """Protect the bytes a persisting snapshot still needs (copy-before-write) from now on; ``server_gone``:
        whether the server is unreachable now (a snapshot that would make the trainer wait is then given up)."""
        info = self.info
        layout = SegmentLayout(info.header_bytes, self.tensors, info.chunk_bytes, len(self.chunks),
                               info.cow_slots, info.cow_slots_offset, info.size)
        self._protector = TrainerProtector(self._mm, layout, header=self.trainer, max_wait_s=max_wait_s,
                                           server_gone=server_gone)

    def before_write(self, step: int, names: Iterable[str]) -> None:
        """Mark ``step`` as being written (a reattach then knows the bytes are torn) and
        make the chunks of ``names`` safe to overwrite; may wait (back-pressure)."""
        self.trainer.begin_write(step)
        self.protect(names)

    def protect(self, names: Iterable[str]) -> None:
        """Make the chunks of ``names`` safe to overwrite, marking no step (the model tensors)."""
        if self.header[Word.SNAP_EPOCH] == 0:
            return  # no snapshot persisting: the common case costs one word read
        for name in names:
            self._protector.before_write_tensor(self._index[name])

    def close(self) -> None:
        """Unregister and unmap; every view handed out must have been dropped first."""
        if self._protector is not None:
            self._protector.close()
            self._protector = None
        if self._registered is not None:
            backend, ptr = self._registered
            backend.unregister_host_memory(ptr)
            self._registered = None
        self.header.release()
        del self._base
        try:
            self._mm.close()
        except BufferError:
            pass  # a view still referenced (a kept state_dict): unmapped when collected
        if self._fd >= 0:
            os.close(self._fd)  # the trainer's presence ends with its mapping
            self._fd = -1
