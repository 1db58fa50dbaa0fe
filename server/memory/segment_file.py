"""One session's shared-memory segment file as the server holds it: :class:`Segment`.

The arena (:mod:`.arena`) creates, maps and frees segments and owns their accounting; a
segment only knows its file, its mapping and who is still borrowing it. Call order::

    segment = arena.create_segment(...)       # file committed, mapped, header initialised
    with segment.borrow() as buffer: ...      # read or write the mapping (snapshot, restore)
    arena.free(segment)                       # unmapped and unlinked once the last borrow ends
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import pathlib
import threading
from collections.abc import Callable, Iterator

from swap_state.common.errors import Unavailable
from swap_state.common.segment import SegmentHeader, SegmentLayout, model_bytes, segment_file_bytes
from swap_state.server.logs import log_event

__all__ = ["Segment"]

log = logging.getLogger("swap_state.server.arena")  # the arena's logger: one place to look


class Segment:
    """One session's shared-memory file, mapped by the server (``buffer``: a writable mmap).

    Hold :meth:`borrow` while using ``buffer`` from code that may outlive the session (a
    snapshot still persisting): the file is unmapped and unlinked after the last borrower.
    """

    def __init__(
        self, name: str, path: pathlib.Path, layout: SegmentLayout, specs_hash: str, charge: int, *,
        lock: threading.Lock, destroy: Callable[[Segment], None], descriptor_bytes: int = 0,
    ) -> None:
        """``lock`` and ``destroy``: the arena's (its lock guards the borrow count; ``destroy``
        runs when the last borrower of a freed segment is done). ``descriptor_bytes``: the
        encoded descriptor's length after the copy slots."""
        self.name = name
        self.path = path
        self.layout = layout
        self.layout_hash = specs_hash
        self.size = layout.size
        """Bytes mapped (the layout; the trainer maps as many)."""
        self.descriptor_bytes = descriptor_bytes
        self.file_bytes = segment_file_bytes(layout, descriptor_bytes)
        """Bytes of the file: the layout, then the descriptor's pages."""
        self.keep_file = False
        """Set at shutdown for a segment whose file stays for the next server to adopt."""
        self.tenant = ""
        """The tenant whose quota (``--tenant-shm-quota``) it is charged to."""
        self.cow_slots = layout.cow_slots
        self.model_bytes = model_bytes(layout.tensors)  # once: stats and scrapes read it often
        self.charge = charge  # bytes counted against the tensor part of the budget
        self.buffer: mmap.mmap | None = None
        self.header: SegmentHeader | None = None
        self.locked = False
        self._lock = lock
        self._destroy = destroy
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
        with self._lock:
            if self._freeing or self.buffer is None:
                raise Unavailable(f"segment {self.name} was freed")
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
