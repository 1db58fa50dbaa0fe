"""Every header word the trainer writes, in one place: the trainer's side of the segment
protocol (:mod:`.segment`). Nothing else on the trainer's side stores into a segment header; a
test fails when another module does. ``trainer_header[Word.X]`` reads any word.

Call order over a trainer's life::

    claim(generation)                      # attach: this generation owns the segment
    begin_write(step) ... end_write()      # around every write of a step (torn-state mark)
        record_chunk_copy(...)             # protocol step 4, inside begin/end, per chunk
        abandon_snapshot(epoch)            # protocol step 6: the server is gone, no wait
    set_fingerprint(value); commit(step)   # after the step's writes: the per-step commit
    withdraw_model() / publish_model(step) # protocol step 5, after the commit (whole state)
"""

from __future__ import annotations

from .segment import HeaderWriter, Word

__all__ = ["TrainerHeader"]


class TrainerHeader(HeaderWriter):
    def claim(self, generation: int) -> None:
        self.segment[Word.TRAINER_GENERATION] = generation

    def begin_write(self, step: int) -> bool:
        """``WRITING_STEP = step + 1`` unless a write is already marked; whether it stored.
        A trainer that dies between this and :meth:`end_write` leaves torn state."""
        if self.segment[Word.WRITING_STEP] != 0:
            return False
        self.segment[Word.WRITING_STEP] = step + 1
        return True

    def end_write(self) -> None:
        """``WRITING_STEP = 0``: every write of the step has landed."""
        self.segment[Word.WRITING_STEP] = 0

    def record_chunk_copy(self, chunk: int, slot: int, epoch: int) -> None:
        """After copying ``chunk`` into trainer ``slot``: ``COW_SLOT``, ``SLOT_TAKEN``, last
        ``COW_EPOCH`` (the server trusts the slot from that store on), and the copy counted."""
        header = self.segment
        header.set_cow_slot(chunk, slot + 1)
        header.set_slot_taken(slot, header.slot_taken(slot) + 1)
        header.set_cow_epoch(chunk, epoch)
        header[Word.COW_COPIES] = header[Word.COW_COPIES] + 1

    def record_backpressure(self, waited_ns: int) -> None:
        header = self.segment
        header[Word.BP_WAITS] = header[Word.BP_WAITS] + 1
        header[Word.BP_WAIT_NS] = header[Word.BP_WAIT_NS] + waited_ns

    def abandon_snapshot(self, epoch: int) -> None:
        """Protocol step 6: ``ABANDONED_EPOCH = epoch``, before overwriting without a copy."""
        self.segment[Word.ABANDONED_EPOCH] = epoch

    def set_fingerprint(self, value: int) -> None:
        """``PARAMS_FINGERPRINT``: the parameters that go with the state (0: not known)."""
        self.segment[Word.PARAMS_FINGERPRINT] = value

    def commit(self, step: int) -> None:
        """``TRAINER_COMMITTED = step + 1``, then ``TRAINER_RESTORED_SEQ = RESTORED_SEQ``, then
        the commit counted. No RPC."""
        header = self.segment
        header[Word.TRAINER_COMMITTED] = step + 1
        header[Word.TRAINER_RESTORED_SEQ] = header[Word.RESTORED_SEQ]
        header[Word.TRAINER_COMMITS] = header[Word.TRAINER_COMMITS] + 1

    def count_state_drop(self) -> None:
        """A kept state dropped as not belonging to the parameters."""
        self.segment[Word.STATE_DROPS] = self.segment[Word.STATE_DROPS] + 1

    def publish_model(self, step: int) -> None:
        """``MODEL_STEP = step + 1``, once every write of the model copy has landed."""
        self.segment[Word.MODEL_STEP] = step + 1

    def withdraw_model(self) -> None:
        """``MODEL_STEP = 0``: the model tensors hold no step's parameters."""
        self.segment[Word.MODEL_STEP] = 0
