"""The server's stager: copies the chunks of one rank's snapshot into spare slots ahead of the trainer (protocol step 2
of :mod:`swap_state.common.segment`), so the trainer's next optimizer step finds them safe instead of copying them
itself. One per :class:`~.writer.RankWriter`, in a thread of its own; the writer starts it, wakes it after every chunk
and stops it before it releases the segment.

A memory-only snapshot's stager copies each chunk straight into its place in the snapshot's file (mapped, in memory)
instead of a slot: that copy is then both the trainer's safety and this host's copy of the snapshot, and the writer,
which follows the stager, only checksums and sends it (one copy of the bytes where a slot and the file took two: the
sender's CPU is what paces replication, docs/benchmarks.md "One copy of each byte on each host").
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from swap_state.common.segment import Word
from swap_state.common.server_header import ServerHeader
from swap_state.server import _posix
from swap_state.server._posix import buffer_address

__all__ = ["Stager"]

log = logging.getLogger(__name__)


# Longest nap of a stager whose ring is full before it looks at PERSISTED_UPTO again (the writer also wakes it after
# every chunk), and longest a writer waits, per chunk, for a busy stager (Stager.yield_to).
_STAGE_WAIT_S = 0.005
_YIELD_MAX_S = 0.5


class Stager:
    """A ring of ``slots`` slots: chunk c goes to slot ``c % slots`` once the writer is done with chunk ``c - slots``,
    so the staged chunks are the ones right after the writer's, which the trainer reaches first; or, started with the
    file's places, every chunk to its place there, in order. ``threads`` threads copy (GIL released); ``STAGED_UPTO``
    is stored after each copied batch, by this thread only."""

    def __init__(self, writer: Any, slots: int, threads: int):
        # ``writer``: the :class:`~.writer.RankWriter` that owns it (not imported: it imports this).
        self.writer, self.slots, self.threads = writer, slots, max(1, threads)
        self.stop_event = threading.Event()
        self.progress = threading.Condition()
        self.staged_chunks = self.staged_bytes = 0  # copied into a stager slot (this thread only)
        self.thread: threading.Thread | None = None
        self.idle = threading.Event()  # set while it has nothing to copy: done, stopped, or its ring is full
        self._base = 0
        self.places: list[int] | None = None  # each chunk's address in the snapshot's mapped file, or slots

    def start(self, segment: memoryview, places: list[int] | None = None) -> None:
        """Copy ``segment``'s chunks into the slots, or each to its address in ``places`` (the writer then follows)."""
        self._base, self.places = buffer_address(segment), places
        self.idle.clear()
        self.thread = threading.Thread(target=self._run, name=f"{threading.current_thread().name}-stage", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        """The writer stored a new ``PERSISTED_UPTO`` (or is done): a full ring may move on."""
        with self.progress:
            self.progress.notify_all()

    def yield_to(self) -> None:
        """The writer's courtesy before each chunk: while the stager can copy, let it (up to
        ``_YIELD_MAX_S``): its copies are what the trainer's next step needs, and the writer's
        pwrite and crc32 would compete with them for CPU and memory bandwidth."""
        if self.thread is not None and not self.idle.is_set():
            self.idle.wait(_YIELD_MAX_S)

    def wait_staged(self, index: int) -> bool:
        """Until chunk ``index`` is staged (True), or the stager ended first (False): a writer that follows it into
        the file never writes a chunk the stager may still copy."""
        header = self.writer.source.header
        while header[Word.STAGED_UPTO] <= index:
            if self.thread is None or not self.thread.is_alive():
                return header[Word.STAGED_UPTO] > index
            with self.progress:
                self.progress.wait(_STAGE_WAIT_S)
        return True

    def stop(self) -> None:
        """Stop and wait for the thread: no stager store or slot write happens after this."""
        self.stop_event.set()
        self.wake()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def _copy(self, chunks) -> tuple[int, int]:
        header, layout, epoch = self.writer.source.header, self.writer.source.layout, self.writer.epoch
        copied = count = 0
        for chunk in chunks:
            if header.cow_epoch(chunk.index) == epoch:
                continue  # the trainer copied it: its slot wins (protocol step 3)
            places = self.places
            into = places[chunk.index] if places else self._base + layout.cow_slots_offset + (
                chunk.index % self.slots) * layout.chunk_bytes
            _posix.memmove(into, self._base + chunk.offset, chunk.nbytes)
            copied += chunk.nbytes
            count += 1
        return copied, count

    def _run(self) -> None:
        writer, chunks = self.writer, self.writer.chunks
        header = writer.source.header
        server_header = ServerHeader(header)  # the stager's one word: STAGED_UPTO
        n, k = len(chunks), self.slots
        batch = 1 if self.threads == 1 else 4 * self.threads
        pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="stage") if self.threads > 1 else None
        position = 0  # next chunk to stage
        try:
            while position < n and not (self.stop_event.is_set() or writer.cancel.is_set()):
                persisted = header[Word.PERSISTED_UPTO]
                if position < persisted:  # the writer is done with those (never the one it reads)
                    position = persisted
                limit = n if self.places else min(n, persisted + k)  # the ring slots of [persisted, limit) are free
                if not writer.model_published():
                    limit = min(limit, writer.model_from)  # protocol step 5
                if position >= limit:
                    self.idle.set()  # the writer's turn
                    with self.progress:
                        self.progress.wait(_STAGE_WAIT_S)
                    continue
                self.idle.clear()
                end = min(limit, position + batch)
                todo = chunks[position:end]
                step = -(-len(todo) // self.threads)
                parts = [todo[i : i + step] for i in range(0, len(todo), step)]  # one without a pool
                futures = [pool.submit(self._copy, part) for part in parts[1:]]  # type: ignore[union-attr]
                results = [self._copy(parts[0])] + [f.result() for f in futures]
                nbytes, copied = sum(r[0] for r in results), sum(r[1] for r in results)
                server_header.staged(end)  # after the copies: the trainer trusts them now
                self.staged_bytes += nbytes
                self.staged_chunks += copied
                position = end
                if self.places:
                    self.wake()  # the writer follows
        except Exception as exc:  # staging is an optimisation: the trainer still copies itself
            log.warning("snapshot stager of %s stopped: %r", writer.source.job_id, exc)
        finally:
            self.idle.set()
            if pool is not None:
                pool.shutdown(wait=True)

