"""Every header word the server writes, in one place (a test fails when another module does): the server's side of the
segment protocol (:mod:`.segment`). Callers: the arena at creation (:meth:`initialize`); a CommitStep RPC or a Restore
(:meth:`record_commit`); the Snapshot call and the writer's release while no stager or writer runs
(:meth:`open_snapshot`, :meth:`close_snapshot`); the writer thread (:meth:`persisted`, :meth:`free_slot`); the stager
thread (:meth:`staged`).
"""

from __future__ import annotations

from .segment import MAGIC, LAYOUT_VERSION, HeaderWriter, SegmentLayout, Word, layout_hash_word

__all__ = ["ServerHeader"]


class ServerHeader(HeaderWriter):
    def initialize(self, layout: SegmentLayout, digest: str = "", descriptor_bytes: int = 0) -> None:
        """Once, on a zero-filled segment: the layout words, the descriptor's place (written
        before; 0 bytes: never adopted), ``LAYOUT_HASH``, and ``MAGIC`` last."""
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
        """``COMMITTED_STEP = step + 1``, then ``RESTORED_SEQ += 1`` (from then on the server's
        value holds: :func:`~.segment.committed_step`)."""
        header = self.segment
        header[Word.COMMITTED_STEP] = step + 1
        header[Word.RESTORED_SEQ] = header[Word.RESTORED_SEQ] + 1

    def free_all_slots(self, cow_slots: int) -> None:
        """``SLOT_FREED[j] = SLOT_TAKEN[j]`` for every slot (only while ``SNAP_EPOCH == 0``)."""
        for slot in range(cow_slots):
            self.free_slot(slot)

    def open_snapshot(self, step: int, stage_slots: int, epoch: int, cow_slots: int) -> None:
        """Protocol step 1, ``SNAP_EPOCH = epoch`` last: the snapshot is consistent from here on."""
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
        """Writer, protocol step 3: chunks ``[0, upto)`` are read (frees their stager slots)."""
        self.segment[Word.PERSISTED_UPTO] = upto

    def free_slot(self, slot: int) -> None:
        """Writer: trainer slot ``slot`` is read and free again (``SLOT_FREED = SLOT_TAKEN``)."""
        self.segment.set_slot_freed(slot, self.segment.slot_taken(slot))

    def close_snapshot(self, cow_slots: int) -> None:
        """End of protocol step 3: ``SNAP_EPOCH = 0``, then every slot freed."""
        self.segment[Word.SNAP_EPOCH] = 0
        self.free_all_slots(cow_slots)
