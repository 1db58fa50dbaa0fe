"""The mirrored tier on its own (a fake peer tier, the real directory): a mirror that fails,
a bug included, at any call of the seam leaves the step durable, its replica state failed with
the reason, and no file open (the chaos run found a bug in the mirror leaking two descriptors
per snapshot, with every snapshot failing)."""

from __future__ import annotations

import os
import threading

import pytest

from swap_state.common.segment import Word, stager_slot_count
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.server.snapshot.tiers.mirror import MirroredTier
from swap_state.server.snapshot.tiers.replica import SendingSink
from swap_state.server.snapshot.tiers.replica_wire import DATA_FRAME_BYTES
from swap_state.server.snapshot.tiers.replicate import ReplicaStates
from swap_state.server.snapshot.tiers.seam import CommitResult, StepWrite
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter
from swap_state.server.snapshot.writing.sink import ChunkSink


def _open_files() -> int:
    """This process's descriptors of files (not its sockets and pipes: another test's server
    thread may close one of those while this test runs)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("/")
        except OSError:
            pass  # closed meanwhile
    return found


class _BrokenPeer:
    """A peer tier whose call ``broken`` raises a bug; the others do nothing."""

    root = "tcp://peer:1"

    def __init__(self, broken: str):
        self.broken, self.discarded = broken, 0

    def _call(self, name: str) -> None:
        if name == self.broken:
            raise RuntimeError(f"a bug in {name}")

    def prepare(self, plan):
        self._call("prepare")
        return StepWrite(plan, "peer/step", ())

    def open_file(self, target, name):
        self._call("open_file")
        raise AssertionError("not reached in these tests")

    def write_file(self, target, name, data):
        self._call("write_file")

    def finish_rank(self, target, rank, files):
        self._call("finish_rank")

    def discard(self, target):
        self.discarded += 1
        return True


@pytest.mark.parametrize("broken", ["prepare", "open_file"])
def test_a_mirror_that_fails_leaves_the_step_durable_and_no_file_open(broken, make_segment, make_coordinator):
    seg = make_segment()
    seg.fill(3)
    coordinator = make_coordinator()
    peer, states = _BrokenPeer(broken), ReplicaStates()
    coordinator.tier = MirroredTier(coordinator.directory, peer, states)
    coordinator.replica_states = states
    opened = []  # after each snapshot: the first may open what the coordinator keeps
    for step in (2, 3, 4, 5):
        seg.fill(step + 1)
        handle = coordinator.start(seg.source("job", step))
        assert handle.wait(20).state is SnapshotState.DURABLE
        handle.thread.join(20)  # it commits, then empties the trash
        found = states.state("job", step)
        assert found.state == "failed" and f"unexpected error: RuntimeError('a bug in {broken}')" in found.error
        opened.append(_open_files())
    assert opened[1:] == opened[:1] * 3, opened
    assert peer.discarded == (4 if broken == "open_file" else 0)  # a prepared step is discarded on the peer


class _RecordingPeer(_BrokenPeer):
    """A peer tier that takes everything: its data file's sink records ``STAGED_UPTO`` at the
    first data chunk it is handed."""

    def __init__(self, header):
        super().__init__(broken="")
        self.header, self.staged_at_first_chunk = header, None

    def open_file(self, target, name):
        peer = self

        class Recording(ChunkSink):
            def room(self):
                return 1 << 20

            def put(self, data, stable=False):
                if self.position and peer.staged_at_first_chunk is None:  # past the header
                    peer.staged_at_first_chunk = peer.header[Word.STAGED_UPTO]
                self._pending = data.nbytes
                return data[:]

            def advance(self):
                self.position += self._pending

            def finish(self):
                pass

        return Recording()

    def finish(self, target, index, layout):
        return CommitResult("peer/step", ())


def test_a_mirrored_file_lets_the_stager_fill_its_ring_first(make_segment, make_coordinator):
    """A replica's copies and sends take the CPU that the stager's copies need (the trainer's next
    step waits for those): the writer lets the stager go first, though its disk is O_DIRECT."""
    seg = make_segment(specs=[(f"layer{i}.exp_avg", "float32", (8, 1024)) for i in range(12)], cow_slots=96)
    seg.fill(3)
    coordinator = make_coordinator()
    peer, states = _RecordingPeer(seg.header), ReplicaStates()
    coordinator.tier = MirroredTier(coordinator.directory, peer, states)
    coordinator.replica_states = states
    handle = coordinator.start(seg.source("job", 2))
    assert handle.wait(20).state is SnapshotState.DURABLE and handle.writer.direct_io
    assert peer.staged_at_first_chunk == min(seg.layout.n_chunks, stager_slot_count(96))


class _Wire:
    """A connection that records the data frames sent (their bytes as they were when sent) and
    answers every request."""

    def __init__(self):
        self.frames = []

    def send_data(self, data):
        self.frames.append(bytes(data))

    def request(self, message):
        self.frames.append(message)
        return {"ok": True}


def test_a_piece_is_sent_as_it_was_put_once_final():
    """A piece is copied when put, before the writer checks what it read (so the check covers
    what is sent: the trainer may overwrite the segment right after the check), and sent at
    ``advance``; a piece placed again (``replace``) is sent as replaced; a stable piece (a slot's)
    is sent from where it lies, uncopied, and let go once sent; never over a frame."""
    wire = _Wire()
    sink = SendingSink(wire, BandwidthLimiter(None), threading.Event())
    first, second = bytearray(b"a" * 100), bytearray(b"b" * 50)
    sink.put(memoryview(first)).release()
    first[:] = b"c" * 100  # the trainer's write, after the check
    assert wire.frames == []
    sink.advance()
    sink.put(memoryview(second)).release()
    sink.replace(memoryview(bytearray(b"d" * 50))).release()  # the check found it torn
    sink.advance()
    slot = bytearray(b"e" * 30)
    with memoryview(slot) as view:
        sink.put(view, stable=True).release()  # a slot's bytes: sent from where they lie, not copied
        slot[:] = b"f" * 30
        sink.advance()
    slot.extend(b"g")  # no view of it is left held: it may resize
    with pytest.raises(ValueError, match="over a data frame"):
        sink.put(memoryview(bytearray(DATA_FRAME_BYTES + 1)))
    sink.finish()
    assert wire.frames == [b"a" * 100, b"d" * 50, b"f" * 30, {"op": "end", "bytes": 180}]
