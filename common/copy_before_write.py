"""The trainer's side of the copy-before-write protocol (:mod:`.segment`, steps 4 and 6), pure Python (the server's
tests play the trainer with it). Called from the *one* thread that writes the segment (its header words have a single
writer): :meth:`TrainerProtector.before_write` before each write into the tensor area (it may copy chunks or wait; one
header word read when no snapshot is persisting), :meth:`~TrainerProtector.close` before unmapping.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from swap_state.common.retry import wait_until
from swap_state.common.segment import Chunk, SegmentHeader, SegmentLayout, Word
from swap_state.common.trainer_header import TrainerHeader

__all__ = ["BackPressureTimeout", "TrainerProtector"]


class BackPressureTimeout(TimeoutError):
    """The trainer waited longer than ``max_wait_s`` for a free copy slot (a stuck server)."""


def _needs_copy(header: SegmentHeader, chunk: int, epoch: int) -> bool:
    return (
        epoch != 0
        and header[Word.STAGED_UPTO] <= chunk
        and header[Word.PERSISTED_UPTO] <= chunk
        and header.cow_epoch(chunk) != epoch
        and header[Word.ABANDONED_EPOCH] != epoch)


class TrainerProtector:
    """Copy-before-write for one mapped segment: :meth:`protect` makes one chunk safe to
    overwrite, :meth:`before_write` every chunk of a byte range."""

    def __init__(self, buffer, layout: SegmentLayout, *, header: SegmentHeader | TrainerHeader,
                 max_wait_s: float | None = None, server_gone: Callable[[], bool] | None = None):
        """``buffer``: the whole segment, writable; ``header``: one over it; ``max_wait_s``: BackPressureTimeout after
        waiting this long (None: no limit); ``server_gone()``: the server is unreachable, so a wait for a slot gives the
        snapshot up instead (protocol step 6)."""
        self._view = memoryview(buffer)
        self.trainer = header if isinstance(header, TrainerHeader) else TrainerHeader(header)
        self.header = self.trainer.segment
        self.layout = layout
        self.max_wait_s = max_wait_s
        self.server_gone = server_gone
        self.chunks = layout.chunks
        self._starts = [c.offset for c in self.chunks]

    def protect(self, chunk: Chunk) -> bool:
        """Make ``chunk`` safe to overwrite; True when it was copied into a slot."""
        header, layout = self.header, self.layout
        epoch = header[Word.SNAP_EPOCH]
        if not _needs_copy(header, chunk.index, epoch):
            return False
        slot = header.free_slot()
        if slot is None:  # back-pressure: wait for a free slot, or for the server to make it safe
            def slot_or_safe() -> bool:
                nonlocal slot, epoch
                slot, epoch = header.free_slot(), header[Word.SNAP_EPOCH]
                safe = not _needs_copy(header, chunk.index, epoch)
                return slot is not None or safe or (self.server_gone is not None and self.server_gone())

            waited_since = time.monotonic_ns()
            try:
                done = wait_until(slot_or_safe, timeout_s=self.max_wait_s, first_s=20e-6, max_s=1e-3)
            finally:
                self.trainer.record_backpressure(time.monotonic_ns() - waited_since)
            if not done:
                raise BackPressureTimeout(f"waited {self.max_wait_s} s for a free copy slot for chunk {chunk.index} "
                                          f"(server persisted {header[Word.PERSISTED_UPTO]} and staged "
                                          f"{header[Word.STAGED_UPTO]} of {layout.n_chunks} chunks)")
            # While waiting the server may have read or staged this chunk, or finished.
            if not _needs_copy(header, chunk.index, epoch):
                return False
            if slot is None:  # the server is gone: nobody will free a slot
                self.trainer.abandon_snapshot(epoch)
                return False
        start = layout.cow_slots_offset + slot * layout.chunk_bytes
        self._view[start : start + chunk.nbytes] = self._view[chunk.offset : chunk.offset + chunk.nbytes]
        # Publication order matters: the server trusts the slot once it sees COW_EPOCH == epoch.
        self.trainer.record_chunk_copy(chunk.index, slot, epoch)
        return True

    def before_write(self, offset: int, nbytes: int) -> int:
        """Protect every chunk overlapping ``[offset, offset + nbytes)``; returns copies made."""
        if nbytes <= 0 or self.header[Word.SNAP_EPOCH] == 0:
            return 0
        first = max(0, bisect.bisect_right(self._starts, offset) - 1)
        last = bisect.bisect_left(self._starts, offset + nbytes)  # chunks [first, last) start before the end
        return sum(self.protect(chunk) for chunk in self.chunks[first:last] if chunk.offset + chunk.nbytes > offset)

    def before_write_tensor(self, tensor_index: int) -> int:
        tensor = self.layout.tensors[tensor_index]
        return self.before_write(tensor.offset, tensor.nbytes)

    def close(self) -> None:
        """Release the view (an mmap cannot be closed while it exists)."""
        self._view.release()
