"""Maps a session's shared-memory segment into the trainer and exposes torch views on it.

Call order::

    mapping = SegmentMapping.open(segment_info)   # mmap + header check
    mapping.register_for_dma(backend)             # once; no-op on CPU
    views = mapping.tensor_views()                # name -> torch.Tensor on the mapping
    ...                                           # the step reads/writes the views
    mapping.close()                               # unregister, drop views, unmap

The views alias the server's memory: writes are visible to the server (and survive a trainer
crash) without any copy through gRPC.
"""

from __future__ import annotations

import mmap
import os

import torch

from swap_state.common.dtypes import DTYPE_NAMES
from swap_state.proto import swap_state_pb2 as pb
from swap_state.common.segment import SegmentHeader, TensorLayout, chunk_table
from swap_state.common.trainer_header import TrainerHeader
from swap_state.common.trainer_presence import hold

__all__ = ["TORCH_DTYPES", "SegmentMapping"]

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""The common dtype table's names as torch dtypes."""


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
        self.trainer = TrainerHeader(self.header)
        """The trainer's writes to the header (the only ones it makes)."""
        self.tensors = tuple(
            TensorLayout(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in info.tensors
        )
        self.chunks = chunk_table(self.tensors, info.chunk_bytes)
        self._registered: tuple[object, int] | None = None

    @classmethod
    def open(cls, info: pb.SegmentInfo) -> SegmentMapping:
        try:
            fd = os.open(info.path, os.O_RDWR)
        except OSError as e:
            raise RuntimeError(
                f"cannot open swap-state segment {info.path}: {e.strerror}; the trainer must "
                "share /dev/shm with the server (docker: ipc: service:<server>; "
                "kubernetes: the same pod or hostIPC)"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size < info.size:
                raise RuntimeError(
                    f"swap-state segment {info.path} has {size} bytes, expected {info.size}"
                )
            mm = mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED)
            hold(fd)  # while this process maps it: a restarted server knows its trainer is alive
        except BaseException:
            os.close(fd)
            raise
        return cls(info, mm, fd)

    @property
    def buffer(self) -> mmap.mmap:
        """The raw mapping (for header and copy-before-write access)."""
        return self._mm

    @property
    def data_ptr(self) -> int:
        return self._base.data_ptr()

    def byte_view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._base[offset : offset + nbytes]

    def tensor_views(self) -> dict[str, torch.Tensor]:
        views = {}
        for t in self.tensors:
            dtype = TORCH_DTYPES[t.dtype]
            views[t.name] = self.byte_view(t.offset, t.nbytes).view(dtype).view(t.shape)
        return views

    def register_for_dma(self, backend) -> None:
        """Pin the whole mapping for device DMA once (cudaHostRegister / aclrtHostRegister),
        in chunks that never split a tensor (``spans``: each tensor's bytes; a chunk ends only
        on a page boundary no tensor straddles, see :func:`~swap_state.client.host_register.page_chunks`).

        The whole mapping is registered either way (header and copy slots too: one range,
        one unregister). The copy slots are no device copy's source or target (the trainer and
        the server fill them from the segment on the host), so they are not spans; their
        boundaries are ``cuts``, where a chunk may also end: a large slot area is then
        registered in chunks within the limit rather than as one."""
        if self._registered is None and backend.is_accelerator:
            spans = [(t.offset, t.nbytes) for t in self.tensors]
            info = self.info
            cuts = [info.cow_slots_offset + i * info.chunk_bytes for i in range(info.cow_slots + 1)]
            backend.register_host_memory(self.data_ptr, info.size, cuts=cuts, spans=spans)
            self._registered = (backend, self.data_ptr)

    def close(self) -> None:
        """Unregister and unmap; every view handed out must have been dropped first."""
        if self._registered is not None:
            backend, ptr = self._registered
            backend.unregister_host_memory(ptr)
            self._registered = None
        self.header.release()
        del self._base
        try:
            self._mm.close()
        except BufferError:
            # A view is still referenced somewhere (e.g. a state_dict the user kept): the
            # mapping stays until it is garbage collected, which is safe; the file is the
            # server's to unlink.
            pass
        if self._fd >= 0:
            os.close(self._fd)  # the trainer's presence ends with its mapping
            self._fd = -1
