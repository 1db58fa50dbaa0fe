"""The shared-memory segment: layout and header words, shared by server and trainer.

A segment is one file under the server's shm directory, owned by one session (job, rank)::

    [ header (page aligned) | tensor 0 | tensor 1 | ... (each page aligned) | cow slots ]

The header is an array of little-endian uint64 words, each with exactly one writer (server or
trainer): no locks; a reader may see an old value, never a torn one (aligned 8-byte stores).

Snapshot protocol for committed step N, epoch e. Chunks are in tensor order (the trainer's
update order); of the ``COW_SLOTS`` spare slots (``CHUNK_BYTES`` each), ``[0, k)`` are the
server's *stager*'s and ``[k, COW_SLOTS)`` the trainer's *fallback* for this epoch; neither side
touches the other's (``k = stager_slot_count``; ``STAGE_SLOTS`` changes only while ``SNAP_EPOCH == 0``):

1. Snapshot(step=N), between steps: before replying the server frees every trainer slot
   (``SLOT_FREED[j] = SLOT_TAKEN[j]``), stores ``SNAP_STEP = N``, ``PERSISTED_UPTO = 0``,
   ``STAGED_UPTO = 0``, ``STAGE_SLOTS = k`` and last ``SNAP_EPOCH = e`` (e > 0, increasing).
   From the reply on the snapshot is *consistent*: the trainer may mutate again.
2. The stager copies chunk c into its slot ``c % k`` (a ring) once the writer is done with
   chunk ``c - k`` (``PERSISTED_UPTO > c - k``); it skips chunks the writer is done with and
   those the trainer copied (``COW_EPOCH[c] == e``), and after each stores ``STAGED_UPTO = c +
   1``: every chunk below it is persisted, in a stager slot, or in a trainer slot.
3. The writer persists chunks in order, from stager slot ``c % k`` when ``c < STAGED_UPTO``,
   else from the segment (zero copy). After the read, if ``COW_EPOCH[c] == e`` (the trainer
   copied it; the read may be torn) it rewrites from trainer slot ``COW_SLOT[c] - 1`` and
   frees it; else if it read the segment and now ``c < STAGED_UPTO`` it rewrites from the
   stager slot. Then ``PERSISTED_UPTO = c + 1`` (which frees the stager slot). When done it
   stops the stager and stores ``SNAP_EPOCH = 0``.
4. Before the trainer overwrites chunk c while ``SNAP_EPOCH == e != 0``, ``PERSISTED_UPTO <=
   c``, ``STAGED_UPTO <= c`` and ``COW_EPOCH[c] != e``, it copies the chunk into a free slot j
   of its own (``SLOT_TAKEN[j] == SLOT_FREED[j]``), stores ``COW_SLOT[c] = j + 1``,
   ``SLOT_TAKEN[j] += 1`` and last ``COW_EPOCH[c] = e``, then overwrites. Without a free slot
   it waits (back-pressure, counted in ``BP_WAITS``/``BP_WAIT_NS``; copies in ``COW_COPIES``).
5. Whole-state snapshots: the model tensors (``model.<fqn>``, the last ones, from
   :attr:`SegmentLayout.model_from` on) change only when the trainer copies step N's
   parameters into them, right before asking for a snapshot of step N. It protects their
   chunks by step 4 first (an earlier epoch may be open) and stores ``MODEL_STEP = N + 1`` once
   the copy has landed; a value above N when the copy begins is withdrawn first (``MODEL_STEP =
   0``), any other stays (a snapshot waiting for it must not wait for a copy that may wait for
   that snapshot's writer).
   Stager and writer start on the first model chunk only once ``MODEL_STEP >= N + 1``
   (bounded: a trainer that never publishes fails the snapshot), so nobody reads those chunks
   before the copy, which writes the very bytes the snapshot holds, is complete.
6. A trainer whose server is unreachable (KeepAlive broke) that would wait in step 4 stores
   ``ABANDONED_EPOCH = e`` and overwrites without a copy. The writer checks it after its last
   read (and per chunk) and fails epoch e. Epochs only grow (a server starting on kept
   segments numbers above every ``COW_EPOCH`` and ``ABANDONED_EPOCH``).

Why the bytes persisted are step N's: the trainer overwrites chunk c in epoch e only after its
own copy (``COW_EPOCH[c] = e`` first) or once ``PERSISTED_UPTO > c`` or ``STAGED_UPTO > c``; so
a torn read is followed by ``COW_EPOCH[c] == e`` or by a clean stager copy, and step 3 checks
both. A stager slot is reused for chunk c + k only after the writer is done with chunk c.

Adoption by a server restarted on the same shm directory and address: ``DESCRIPTOR_BYTES`` of JSON
(:class:`~.segment_descriptor.SegmentDescriptor`) lie at ``DESCRIPTOR_OFFSET`` (the layout's ``size``, outside what the
trainer maps), ``LAYOUT_HASH`` holds the layout hash's first 8 bytes, ``TRAINER_GENERATION`` the owning generation;
:mod:`swap_state.server.memory.adopt` checks all of it and closes an epoch left open (never listed). No torch, no grpc.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import math
import mmap
from collections.abc import Sequence

from .dtypes import DTYPE_ITEMSIZE
from .names import is_model_tensor

__all__ = [
    "TensorSpec", "MAGIC", "LAYOUT_VERSION", "PAGE_BYTES", "Word", "TensorLayout", "Chunk", "SegmentLayout",
    "SegmentHeader", "align_up", "layout_hash", "layout_hash_word", "segment_file_bytes", "tensor_nbytes",
    "plan_segment", "chunk_table", "committed_step", "ASSUMED_FWD_BWD_S", "ASSUMED_PERSIST_BYTES_PER_S",
    "CopyBudget", "copy_budget_needed", "stager_slot_count", "model_bytes"]

MAGIC = int.from_bytes(b"SWAPST01", "little")
LAYOUT_VERSION = 4  # 2: STAGE_SLOTS / STAGED_UPTO; 3: MODEL_STEP; 4: descriptor, ABANDONED_EPOCH
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
    PERSISTED_UPTO = 10  # server (writer): chunks [0, n) of SNAP_EPOCH are read, need no copy
    COMMITTED_STEP = 11  # server: step + 1 recorded by a CommitStep RPC or a Restore (0: none)
    STAGE_SLOTS = 12  # server: slots [0, n) are the stager's this epoch, the rest the trainer's
    STAGED_UPTO = 13  # server (stager): chunks [0, n) of SNAP_EPOCH are safe (staged/persisted)
    LAYOUT_HASH = 14  # server, at creation: the layout hash's first 8 bytes (adoption checks it)
    RESTORED_SEQ = 15  # server: restores into this segment so far
    TRAINER_GENERATION = 16  # trainer: the generation that owns the segment now
    WRITING_STEP = 17  # trainer: step + 1 being written (0: not mutating; 1 during a restore it may lose)
    COW_COPIES = 18  # trainer: chunks copied before write, all snapshots
    BP_WAITS = 19  # trainer: waits for a free cow slot, all snapshots
    BP_WAIT_NS = 20  # trainer: nanoseconds spent in those waits
    DESCRIPTOR_OFFSET = 21  # server, at creation: where the segment's descriptor starts
    DESCRIPTOR_BYTES = 22  # server, at creation: its length (0: none, never adopted)
    TRAINER_COMMITTED = 24  # trainer: last committed step + 1 (0: none): the per-step commit
    TRAINER_RESTORED_SEQ = 25  # trainer: the RESTORED_SEQ its last commit came after
    TRAINER_COMMITS = 26  # trainer: steps committed, all generations
    PARAMS_FINGERPRINT = 27  # trainer: fingerprint of the parameters of the committed step
    STATE_DROPS = 28  # trainer: kept states dropped as not belonging to the parameters
    MODEL_STEP = 29  # trainer: step + 1 whose model tensors are completely copied (0: none)
    ABANDONED_EPOCH = 30  # trainer: a snapshot epoch it stopped protecting, its server gone


TensorSpec = tuple[str, str, tuple[int, ...]]
"""A checked tensor of a segment: name, dtype name, shape (the server checks them on Allocate)."""


def committed_step(header: "SegmentHeader") -> int | None:
    """The last committed step the segment holds, None when none: the trainer's
    ``TRAINER_COMMITTED`` once it committed after the server's last ``RESTORED_SEQ``, else the
    server's ``COMMITTED_STEP`` (in between a reader sees the older step, never a wrong one)."""
    trainer_current = header[Word.TRAINER_RESTORED_SEQ] == header[Word.RESTORED_SEQ]
    value = header[Word.TRAINER_COMMITTED if trainer_current else Word.COMMITTED_STEP]
    return value - 1 if value else None


def stager_slot_count(cow_slots: int) -> int:
    """Slots the server's stager takes of ``cow_slots``; the rest (at least one) stay the
    trainer's fallback. None below 3 slots: a ring of one slot could only stage the chunk being read."""
    return 0 if cow_slots <= 2 else cow_slots - max(1, cow_slots // 32)


ASSUMED_PERSIST_BYTES_PER_S = 1e9
"""Persist bandwidth assumed until a snapshot was measured (what moves ``PERSISTED_UPTO``)."""
ASSUMED_FWD_BWD_S = 0.1
"""Forward + backward time assumed before the trainer's next optimizer step (short on purpose: the warning errs early)."""


def copy_budget_needed(state_bytes: int, persist_bytes_per_s: float, fwd_bwd_s: float) -> int:
    """Copy-slot bytes a pause-free snapshot needs: what the writer cannot persist during one forward/backward."""
    return max(0, int(state_bytes - persist_bytes_per_s * fwd_bwd_s))


@dataclasses.dataclass(frozen=True)
class CopyBudget:
    """The memory rule for one segment: a snapshot does not slow the trainer when its copy slots
    cover what the disk cannot persist within one forward/backward."""

    state_bytes: int
    slot_bytes: int
    """Bytes of its copy slots (stager's and trainer's)."""
    persist_bytes_per_s: float
    persist_measured: bool
    """Whether that bandwidth was measured on this server (else assumed)."""
    fwd_bwd_s: float

    @property
    def needed_bytes(self) -> int:
        return copy_budget_needed(self.state_bytes, self.persist_bytes_per_s, self.fwd_bwd_s)

    @property
    def short_bytes(self) -> int:
        return max(0, self.needed_bytes - self.slot_bytes)

    def warning(self) -> str:
        """Empty when the budget covers the need, else the numbers and what to do."""
        if not self.short_bytes:
            return ""
        how = "measured" if self.persist_measured else "assumed"
        return (f"copy budget short by {self.short_bytes} bytes: {self.slot_bytes} bytes of copy "
                f"slots, {self.needed_bytes} needed = state {self.state_bytes} bytes - persist "
                f"{self.persist_bytes_per_s / 1e9:.2f} GB/s ({how}) x forward/backward "
                f"{self.fwd_bwd_s:g} s (assumed); snapshots will make the trainer copy or wait: "
                f"raise --cow-budget by {self.short_bytes} bytes")


def model_bytes(tensors: Sequence["TensorLayout"]) -> int:
    """Bytes of a segment's model tensors (parameters and persistent buffers)."""
    return sum(t.nbytes for t in tensors if is_model_tensor(t.name))


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

    @functools.cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        """:func:`chunk_table` of the layout, made once (not again in each snapshot's stall)."""
        return tuple(chunk_table(self.tensors, self.chunk_bytes))

    @functools.cached_property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def names_unique(self) -> bool:
        return len({t.name for t in self.tensors}) == len(self.tensors)

    @functools.cached_property
    def model_from(self) -> int:
        """Index of the first chunk of the model tensors (protocol step 5); n_chunks if none."""
        first = next((i for i, t in enumerate(self.tensors) if is_model_tensor(t.name)), len(self.tensors))
        return next((c.index for c in self.chunks if c.tensor_index >= first), len(self.chunks))


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(int(dim) for dim in shape) * DTYPE_ITEMSIZE[dtype]


def layout_hash(specs: Sequence[tuple[str, str, Sequence[int]]]) -> str:
    """Digest of (name, dtype, shape) in order: equal iff a reattach may reuse a segment."""
    digest = hashlib.sha256()
    for name, dtype, shape in specs:
        digest.update(f"{name}\0{dtype}\0{','.join(str(int(d)) for d in shape)}\n".encode())
    return digest.hexdigest()


def layout_hash_word(digest: str) -> int:
    return int(digest[:16], 16)


def segment_file_bytes(layout: "SegmentLayout", descriptor_bytes: int) -> int:
    """The segment file's size: the layout, then the descriptor, padded to a page."""
    return layout.size + align_up(descriptor_bytes)


def plan_segment(specs: Sequence[tuple[str, str, Sequence[int]]], chunk_bytes: int,
                 max_cow_slots: int) -> SegmentLayout:
    """Place tensors at page-aligned offsets after the header, then the cow slots (at most one
    per chunk: more could never be used)."""
    if chunk_bytes <= 0 or chunk_bytes % PAGE_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {PAGE_BYTES}")
    sizes = [tensor_nbytes(dtype, shape) for _, dtype, shape in specs]
    n_chunks = sum(-(-nbytes // chunk_bytes) for nbytes in sizes)
    cow_slots = max(0, min(max_cow_slots, n_chunks))
    header = offset = align_up((FIXED_WORDS + 2 * n_chunks + 2 * cow_slots) * 8)
    tensors = []
    for (name, dtype, shape), nbytes in zip(specs, sizes):
        tensors.append(TensorLayout(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
        offset = align_up(offset + nbytes)
    return SegmentLayout(header, tuple(tensors), chunk_bytes, n_chunks, cow_slots, offset,
                         offset + cow_slots * chunk_bytes)


def chunk_table(tensors: Sequence[TensorLayout], chunk_bytes: int) -> list[Chunk]:
    """Chunks in update order: each tensor split into pieces of at most ``chunk_bytes``."""
    chunks: list[Chunk] = []
    for tensor_index, tensor in enumerate(tensors):
        for start in range(0, tensor.nbytes, chunk_bytes):
            nbytes = min(chunk_bytes, tensor.nbytes - start)
            chunks.append(Chunk(len(chunks), tensor_index, tensor.offset + start, nbytes))
    return chunks


class SegmentHeader:
    """Typed access to the header words of a mapped segment (``buffer``: an mmap or memoryview)."""

    def __init__(self, buffer, n_chunks: int | None = None, cow_slots: int | None = None):
        with memoryview(buffer)[: FIXED_WORDS * 8].cast("Q") as fixed:
            n_chunks = fixed[Word.N_CHUNKS] if n_chunks is None else n_chunks
            cow_slots = fixed[Word.COW_SLOTS] if cow_slots is None else cow_slots
        self._all = memoryview(buffer)[: (FIXED_WORDS + 2 * n_chunks + 2 * cow_slots) * 8].cast("Q")
        self.n_chunks = n_chunks
        self.cow_slots = cow_slots
        self._cow_epoch = FIXED_WORDS
        self._cow_slot = FIXED_WORDS + n_chunks
        self._slot_taken = FIXED_WORDS + 2 * n_chunks
        self._slot_freed = FIXED_WORDS + 2 * n_chunks + cow_slots

    def check(self) -> None:
        if self._all[Word.MAGIC] != MAGIC or self._all[Word.VERSION] != LAYOUT_VERSION:
            raise ValueError(f"not a swap-state segment of layout version {LAYOUT_VERSION}")

    def __getitem__(self, word: Word) -> int:
        return self._all[word]

    def __setitem__(self, word: Word, value: int) -> None:
        self._all[word] = value

    def cow_epoch(self, chunk: int) -> int:
        return self._all[self._cow_epoch + chunk]

    def highest_cow_epoch(self) -> int:
        return max(self._all[self._cow_epoch : self._cow_epoch + self.n_chunks], default=0)

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
        """A free slot of the trainer's own (``[STAGE_SLOTS, COW_SLOTS)``), or None."""
        return next((slot for slot in range(min(self._all[Word.STAGE_SLOTS], self.cow_slots), self.cow_slots)
                     if self.slot_taken(slot) == self.slot_freed(slot)), None)

    def release(self) -> None:
        self._all.release()


class HeaderWriter:
    """Base of the two writers of a header (:mod:`.server_header`, :mod:`.trainer_header`)."""

    def __init__(self, header: SegmentHeader):
        self.segment = header  # reads of every word, the cow table, the slots

    def __getitem__(self, word: Word) -> int:
        return self.segment[word]
