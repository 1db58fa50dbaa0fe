"""The trainer's guard on its segment: marks steps being written and protects the bytes a
persisting snapshot still needs (copy-before-write, :mod:`swap_state.common.segment`).

Per step, from the one thread that writes the segment: ``before_write(step, names)`` per
slice before its bytes change, ``end_write()`` once all are written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from swap_state.client.remote.segment_mapping import SegmentMapping
from swap_state.common.segment import SegmentLayout, Word
from swap_state.common.copy_before_write import TrainerProtector

__all__ = ["SnapshotGuard"]


class SnapshotGuard:
    """One per mapped segment. ``server_gone``: whether the server is unreachable now (a
    snapshot that would make the trainer wait is then given up: protocol step 6)."""

    def __init__(self, mapping: SegmentMapping, max_wait_s: float | None,
                 server_gone: Callable[[], bool] | None = None):
        self.header = mapping.header
        self._trainer = mapping.trainer
        info = mapping.info
        layout = SegmentLayout(info.header_bytes, mapping.tensors, info.chunk_bytes, len(mapping.chunks),
                               info.cow_slots, info.cow_slots_offset, info.size)
        self._protector = TrainerProtector(mapping.buffer, layout, header=mapping.trainer,
                                           max_wait_s=max_wait_s, server_gone=server_gone)
        self._index = {t.name: i for i, t in enumerate(mapping.tensors)}

    def before_write(self, step: int, names: Iterable[str]) -> None:
        """Mark ``step`` as being written (a reattach then knows the bytes are torn) and
        make the chunks of ``names`` safe to overwrite; may wait (back-pressure)."""
        self._trainer.begin_write(step)
        self.protect(names)

    def protect(self, names: Iterable[str]) -> None:
        """Make the chunks of ``names`` safe to overwrite, marking no step (the model tensors)."""
        if self.header[Word.SNAP_EPOCH] == 0:
            return  # no snapshot persisting: the common case costs one word read
        for name in names:
            self._protector.before_write_tensor(self._index[name])

    def end_write(self) -> None:
        self._trainer.end_write()

    def close(self) -> None:
        self._protector.close()
