"""The shared-memory segment: layout and header words, shared by server and trainer.

A segment is one file under the server's shm directory, owned by one session (job, rank)::

    [ header (page aligned) | tensor 0 | tensor 1 | ... (each page aligned) | cow slots ]

The header is an array of little-endian uint64 words. Every word has exactly one writer
(the server or the trainer), so no locks are needed; a reader may see an old value, never a
torn one (aligned 8-byte stores).

Snapshot protocol (copy-before-write), for a snapshot of committed step N:

1. The trainer calls Snapshot(step=N) between steps. Before replying, the server publishes
   ``SNAP_STEP = N``, ``PERSISTED_UPTO = 0`` and then ``SNAP_EPOCH = e`` (e > 0, increasing).
   From the reply on, the snapshot is *consistent*: the trainer may mutate again.
2. The server persists chunks in order (the chunk order is the tensor order of the segment,
   which is the order the trainer updates them). After it has finished reading chunk c it
   stores ``PERSISTED_UPTO = c + 1``. When done it stores ``SNAP_EPOCH = 0``.
3. Before the trainer overwrites chunk c while ``SNAP_EPOCH == e != 0`` and
   ``PERSISTED_UPTO <= c`` and ``COW_EPOCH[c] != e``, it copies the chunk into a free spare
   slot j (free: ``SLOT_TAKEN[j] == SLOT_FREED[j]``), then stores ``COW_SLOT[c] = j + 1``,
   ``SLOT_TAKEN[j] += 1`` and last ``COW_EPOCH[c] = e``; only then it overwrites the chunk.
   With no free slot it waits (back-pressure) and counts the wait in ``BP_WAITS`` and
   ``BP_WAIT_NS``; every copy is counted in ``COW_COPIES``.
4. The server reads chunk c from the segment, and *after* the read checks ``COW_EPOCH[c]``:
   if it equals e, the trainer may have overwritten the chunk during the read, so the server
   reads slot ``COW_SLOT[c] - 1`` instead (which holds step N's bytes), then frees it with
   ``SLOT_FREED[j] = SLOT_TAKEN[j]``.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import mmap
from collections.abc import Sequence

from .dtypes import DTYPE_ITEMSIZE

__all__ = [
    "MAGIC",
    "LAYOUT_VERSION",
    "PAGE_BYTES",
    "DTYPE_ITEMSIZE",
    "Word",
    "TensorLayout",
    "Chunk",
    "SegmentLayout",
    "SegmentHeader",
    "align_up",
    "layout_hash",
    "plan_segment",
    "chunk_table",
    "committed_step",
]

MAGIC = int.from_bytes(b"SWAPST01", "little")
LAYOUT_VERSION = 1
PAGE_BYTES = mmap.PAGESIZE
FIXED_WORDS = 32



class Word(enum.IntEnum):
    """Index of a fixed header word; the comment names its single writer."""

    MAGIC = 0  # server, at creation
    VERSION = 1  # server, at creation
    HEADER_BYTES = 2  # server, at creation
    N_TENSORS = 3  # server, at creation
    N_CHUNKS = 4  # server, at creation
    CHUNK_BYTES = 5  # server, at creation
    COW_SLOTS = 6  # server, at creation
    COW_SLOTS_OFFSET = 7  # server, at creation
    SNAP_EPOCH = 8  # server: id of the snapshot being persisted, 0 when none
    SNAP_STEP = 9  # server: the step that snapshot holds
    PERSISTED_UPTO = 10  # server: chunks [0, n) of SNAP_EPOCH are read and need no copy
    COMMITTED_STEP = 11  # server: step + 1 recorded by a CommitStep RPC or a Restore (0: none)
    RESTORED_SEQ = 15  # server: restores into this segment so far
    TRAINER_GENERATION = 16  # trainer: the generation that owns the segment now
    WRITING_STEP = 17  # trainer: step + 1 being written (0: not mutating)
    COW_COPIES = 18  # trainer: chunks copied before write, all snapshots
    BP_WAITS = 19  # trainer: waits for a free cow slot, all snapshots
    BP_WAIT_NS = 20  # trainer: nanoseconds spent in those waits
    TRAINER_COMMITTED = 24  # trainer: last committed step + 1 (0: none): the per-step commit
    TRAINER_RESTORED_SEQ = 25  # trainer: the RESTORED_SEQ its last commit came after
    TRAINER_COMMITS = 26  # trainer: steps committed, all generations
    PARAMS_FINGERPRINT = 27  # trainer: fingerprint of the parameters of the committed step
    STATE_DROPS = 28  # trainer: kept states dropped as not belonging to the parameters


def committed_step(header: "SegmentHeader") -> int | None:
    """The last committed step the segment holds, None when none.

    The trainer commits a step by storing ``TRAINER_COMMITTED = step + 1`` (no RPC) after
    its writes of the step are complete and ``WRITING_STEP`` is cleared; it stores
    ``TRAINER_RESTORED_SEQ = RESTORED_SEQ`` before. A Restore (or a CommitStep RPC) is the
    server's: ``COMMITTED_STEP``, then ``RESTORED_SEQ += 1``. Whichever came last holds: the
    server's value until the trainer commits again after it.
    """
    if header[Word.TRAINER_RESTORED_SEQ] == header[Word.RESTORED_SEQ] and header[Word.TRAINER_COMMITTED]:
        return header[Word.TRAINER_COMMITTED] - 1
    server = header[Word.COMMITTED_STEP]
    return server - 1 if server else None


def align_up(value: int, alignment: int = PAGE_BYTES) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    index: int
    tensor_index: int
    offset: int  # byte offset in the segment
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    header_bytes: int
    tensors: tuple[TensorLayout, ...]
    chunk_bytes: int
    n_chunks: int
    cow_slots: int
    cow_slots_offset: int
    size: int


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * DTYPE_ITEMSIZE[dtype]


def layout_hash(specs: Sequence[tuple[str, str, Sequence[int]]]) -> str:
    """Digest of (name, dtype, shape) in order: equal iff a reattach may reuse a segment."""
    digest = hashlib.sha256()
    for name, dtype, shape in specs:
        digest.update(f"{name}\0{dtype}\0{','.join(str(int(d)) for d in shape)}\n".encode())
    return digest.hexdigest()


def _count_chunks(nbytes_list: Sequence[int], chunk_bytes: int) -> int:
    return sum((nbytes + chunk_bytes - 1) // chunk_bytes for nbytes in nbytes_list)


def header_bytes_for(n_chunks: int, cow_slots: int) -> int:
    words = FIXED_WORDS + 2 * n_chunks + 2 * cow_slots
    return align_up(words * 8)


def plan_segment(
    specs: Sequence[tuple[str, str, Sequence[int]]],
    chunk_bytes: int,
    max_cow_slots: int,
) -> SegmentLayout:
    """Place tensors at page-aligned offsets after the header, then the cow slots.

    ``max_cow_slots`` is capped at the number of chunks (more could never be used).
    """
    if chunk_bytes <= 0 or chunk_bytes % PAGE_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {PAGE_BYTES}")
    sizes = [tensor_nbytes(dtype, shape) for _, dtype, shape in specs]
    n_chunks = _count_chunks(sizes, chunk_bytes)
    cow_slots = max(0, min(max_cow_slots, n_chunks))
    header = header_bytes_for(n_chunks, cow_slots)
    offset = header
    tensors = []
    for (name, dtype, shape), nbytes in zip(specs, sizes):
        tensors.append(TensorLayout(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
        offset = align_up(offset + nbytes)
    cow_offset = offset
    size = cow_offset + cow_slots * chunk_bytes
    return SegmentLayout(header, tuple(tensors), chunk_bytes, n_chunks, cow_slots, cow_offset, size)


def chunk_table(tensors: Sequence[TensorLayout], chunk_bytes: int) -> list[Chunk]:
    """Chunks in update order: each tensor split into pieces of at most ``chunk_bytes``."""
    chunks: list[Chunk] = []
    for tensor_index, tensor in enumerate(tensors):
        start = 0
        while start < tensor.nbytes:
            nbytes = min(chunk_bytes, tensor.nbytes - start)
            chunks.append(Chunk(len(chunks), tensor_index, tensor.offset + start, nbytes))
            start += nbytes
    return chunks


class SegmentHeader:
    """Typed access to the header words of a mapped segment.

    ``buffer`` is any writable buffer over the segment (an ``mmap`` or a memoryview of it).
    """

    def __init__(self, buffer, n_chunks: int | None = None, cow_slots: int | None = None):
        self._words = memoryview(buffer)[: FIXED_WORDS * 8].cast("Q")
        n_chunks = self._words[Word.N_CHUNKS] if n_chunks is None else n_chunks
        cow_slots = self._words[Word.COW_SLOTS] if cow_slots is None else cow_slots
        words = FIXED_WORDS + 2 * n_chunks + 2 * cow_slots
        self._all = memoryview(buffer)[: words * 8].cast("Q")
        self.n_chunks = n_chunks
        self.cow_slots = cow_slots
        self._cow_epoch = FIXED_WORDS
        self._cow_slot = FIXED_WORDS + n_chunks
        self._slot_taken = FIXED_WORDS + 2 * n_chunks
        self._slot_freed = FIXED_WORDS + 2 * n_chunks + cow_slots

    def initialize(self, layout: SegmentLayout) -> None:
        """Server only, once, on a zero-filled segment."""
        self._all[Word.VERSION] = LAYOUT_VERSION
        self._all[Word.HEADER_BYTES] = layout.header_bytes
        self._all[Word.N_TENSORS] = len(layout.tensors)
        self._all[Word.N_CHUNKS] = layout.n_chunks
        self._all[Word.CHUNK_BYTES] = layout.chunk_bytes
        self._all[Word.COW_SLOTS] = layout.cow_slots
        self._all[Word.COW_SLOTS_OFFSET] = layout.cow_slots_offset
        self._all[Word.MAGIC] = MAGIC  # last: a reader seeing MAGIC sees the rest

    def check(self) -> None:
        if self._all[Word.MAGIC] != MAGIC or self._all[Word.VERSION] != LAYOUT_VERSION:
            raise ValueError("not a swap-state segment of layout version 1")

    def __getitem__(self, word: Word) -> int:
        return self._all[word]

    def __setitem__(self, word: Word, value: int) -> None:
        self._all[word] = value

    def cow_epoch(self, chunk: int) -> int:
        return self._all[self._cow_epoch + chunk]

    def set_cow_epoch(self, chunk: int, epoch: int) -> None:
        self._all[self._cow_epoch + chunk] = epoch

    def cow_slot(self, chunk: int) -> int:
        return self._all[self._cow_slot + chunk]

    def set_cow_slot(self, chunk: int, slot_plus_one: int) -> None:
        self._all[self._cow_slot + chunk] = slot_plus_one

    def slot_taken(self, slot: int) -> int:
        return self._all[self._slot_taken + slot]

    def set_slot_taken(self, slot: int, count: int) -> None:
        self._all[self._slot_taken + slot] = count

    def slot_freed(self, slot: int) -> int:
        return self._all[self._slot_freed + slot]

    def set_slot_freed(self, slot: int, count: int) -> None:
        self._all[self._slot_freed + slot] = count

    def free_slot(self) -> int | None:
        """A slot the trainer may take now, or None."""
        for slot in range(self.cow_slots):
            if self.slot_taken(slot) == self.slot_freed(slot):
                return slot
        return None

    def release(self) -> None:
        self._words.release()
        self._all.release()
