"""Every header word the server writes, in one place: the server's side of the segment
protocol (:mod:`swap_state.common.segment`), the counterpart of
:mod:`swap_state.common.trainer_header`. Nothing else on the server's side stores into a
segment header; a test fails when another module does.

Which server thread stores which word (one at a time per word):

- the arena, once at creation: the layout words, the descriptor's place and the layout hash,
  ``MAGIC`` last (:meth:`initialize`);
- a CommitStep RPC or a Restore: ``COMMITTED_STEP``, then ``RESTORED_SEQ``
  (:meth:`record_commit`);
- the Snapshot call (protocol step 1) and the writer's release (step 3's end), while no
  stager or writer of the segment runs: ``SNAP_STEP``, ``PERSISTED_UPTO``, ``STAGED_UPTO``,
  ``STAGE_SLOTS``, ``SNAP_EPOCH``, ``SLOT_FREED`` (:meth:`open_snapshot`, :meth:`close_snapshot`);
- the writer thread: ``PERSISTED_UPTO`` and ``SLOT_FREED`` (:meth:`persisted`,
  :meth:`free_slot`);
- the stager thread: ``STAGED_UPTO`` (:meth:`staged`).
"""

from __future__ import annotations

from .segment import MAGIC, LAYOUT_VERSION, SegmentHeader, SegmentLayout, Word, layout_hash_word

__all__ = ["ServerHeader"]


class ServerHeader:
    """The server's writes to one segment header."""

    def __init__(self, header: SegmentHeader):
        self.segment = header
        """The header itself, for reads."""

    def __getitem__(self, word: Word) -> int:
        return self.segment[word]

    def initialize(self, layout: SegmentLayout, digest: str = "", descriptor_bytes: int = 0) -> None:
        """Once, on a zero-filled segment: the layout words, where its descriptor is (at
        ``layout.size``, ``descriptor_bytes`` long, written before this; 0: none, never
        adopted) and ``LAYOUT_HASH`` of ``digest``, ``MAGIC`` last (a reader that sees
        ``MAGIC`` sees the rest)."""
        header = self.segment
        header[Word.DESCRIPTOR_OFFSET] = layout.size
        header[Word.DESCRIPTOR_BYTES] = descriptor_bytes
        header[Word.LAYOUT_HASH] = layout_hash_word(digest) if digest else 0
        header[Word.VERSION] = LAYOUT_VERSION
        header[Word.HEADER_BYTES] = layout.header_bytes
        header[Word.N_TENSORS] = len(layout.tensors)
        header[Word.N_CHUNKS] = layout.n_chunks
        header[Word.CHUNK_BYTES] = layout.chunk_bytes
        header[Word.COW_SLOTS] = layout.cow_slots
        header[Word.COW_SLOTS_OFFSET] = layout.cow_slots_offset
        header[Word.MAGIC] = MAGIC

    def record_commit(self, step: int) -> None:
        """A CommitStep RPC or a Restore: ``COMMITTED_STEP = step + 1``, then
        ``RESTORED_SEQ += 1`` (last: from then on the server's value holds, see
        :func:`~swap_state.common.segment.committed_step`)."""
        header = self.segment
        header[Word.COMMITTED_STEP] = step + 1
        header[Word.RESTORED_SEQ] = header[Word.RESTORED_SEQ] + 1

    # -- snapshots (protocol steps 1-3) ---------------------------------------------------
    def free_all_slots(self, cow_slots: int) -> None:
        """``SLOT_FREED[j] = SLOT_TAKEN[j]`` for every slot (only while no trainer can be taking
        one for a live epoch: before ``SNAP_EPOCH`` is published and after it is cleared)."""
        for slot in range(cow_slots):
            self.free_slot(slot)

    def open_snapshot(self, step: int, stage_slots: int, epoch: int, cow_slots: int) -> None:
        """Protocol step 1: every slot freed, ``SNAP_STEP``, ``PERSISTED_UPTO = 0``,
        ``STAGED_UPTO = 0``, ``STAGE_SLOTS`` and last ``SNAP_EPOCH = epoch`` (the trainer keys
        everything on it): the snapshot is consistent from here on."""
        header = self.segment
        self.free_all_slots(cow_slots)
        header[Word.SNAP_STEP] = step
        header[Word.PERSISTED_UPTO] = 0
        header[Word.STAGED_UPTO] = 0
        header[Word.STAGE_SLOTS] = stage_slots  # the trainer's slots: [stage_slots, cow_slots)
        header[Word.SNAP_EPOCH] = epoch

    def staged(self, upto: int) -> None:
        """Stager, protocol step 2: chunks ``[0, upto)`` are safe (after the copies)."""
        self.segment[Word.STAGED_UPTO] = upto

    def persisted(self, upto: int) -> None:
        """Writer, protocol step 3: chunks ``[0, upto)`` are read (also frees the stager slot of
        chunk ``upto - 1``)."""
        self.segment[Word.PERSISTED_UPTO] = upto

    def free_slot(self, slot: int) -> None:
        """Writer: trainer slot ``slot`` is read and free again (``SLOT_FREED = SLOT_TAKEN``)."""
        self.segment.set_slot_freed(slot, self.segment.slot_taken(slot))

    def close_snapshot(self, cow_slots: int) -> None:
        """End of protocol step 3: ``SNAP_EPOCH = 0`` (the trainer stops copying), then every
        slot freed."""
        self.segment[Word.SNAP_EPOCH] = 0
        self.free_all_slots(cow_slots)
