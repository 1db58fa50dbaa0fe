"""The server makes a snapshot safe ahead of the trainer: its stager copies the chunks the
writer has not reached into the stager's slots (protocol steps 1-4 of
``swap_state.common.segment``), so the trainer copies a chunk itself only when neither the
writer nor the stager got there, and every race between the three ends with step N's bytes."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import pytest
from snapshot_kit import SPECS, Trainer, metadata_for

from swap_state.common.copy_before_write import TrainerProtector
from swap_state.common.segment import CopyBudget, Word, plan_segment, stager_slot_count
from swap_state.common.addresses import parse_address
from swap_state.common.snapshot_format import rank_data_name
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.replica_receiver import ReplicaReceiver
from swap_state.server.snapshot.tiers.replica_wire import PeerCredentials
from swap_state.server.snapshot.tiers.spares import SpareFiles
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.snapshot.writing import copy_ahead as snapshot_stager
from swap_state.server.snapshot.writing import writer as snapshot_writer
from swap_state.server.snapshot.coordinator import SnapshotState

from test_snapshot_consistency import _file_tensors

# Enough chunks for a ring smaller than the state: 4 KiB chunks.
WIDE = [(f"layer{i}.exp_avg", "float32", (8, 1024)) for i in range(12)]  # 32 KiB each, 96 chunks


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _exact(seg, status, at_step_n) -> None:
    assert status.state is SnapshotState.DURABLE, status.error
    assert _file_tensors(status.path + "/" + rank_data_name(0)) == at_step_n
    assert seg.header[Word.SNAP_EPOCH] == 0 and seg.slots_all_free()


def _in_memory(directory: SnapshotDirectory) -> SnapshotDirectory:
    """``directory`` made as the server makes a directory in memory (with its spare files)."""
    directory.create_root()
    directory.spares = SpareFiles(directory.root)
    return directory


@pytest.fixture
def memory_only(make_coordinator, private_shm_dir, tmp_path):
    """``make(**settings)``: a coordinator whose memory-only snapshots go to a directory in memory (/dev/shm) and to
    a peer's (a replica receiver in this process, its directory the second item)."""
    secret = tmp_path / "replica-secret"
    secret.write_text("a-replica-secret-of-32-bytes-xyz")
    secret.chmod(0o600)
    peer_dir = _in_memory(SnapshotDirectory(os.path.join(private_shm_dir, "replicas")))
    receiver = ReplicaReceiver(parse_address("tcp://127.0.0.1:0"), PeerCredentials(secret.read_bytes()), peer_dir,
                               size=64 << 20)
    peers = f"tcp://127.0.0.1:{receiver.start()}"
    memory = _in_memory(SnapshotDirectory(os.path.join(private_shm_dir, "memory")))
    yield (lambda **kwargs: make_coordinator(replica_peers=peers, replica_secret_file=secret, memory=memory,
                                             **kwargs)), peer_dir
    receiver.close()


def _memory_only_exact(seg, coordinator, status, peer_dir, at_step_n) -> None:
    """This host's memory-only copy and the peer's both hold step N's bytes."""
    _exact(seg, status, at_step_n)
    assert coordinator.replica_states.state("job", 5).state == "replicated"
    [replica] = peer_dir.root.glob(f"job/*/{rank_data_name(0)}")
    assert _file_tensors(str(replica)) == at_step_n


def test_slot_split_leaves_the_trainer_a_fallback():
    assert [stager_slot_count(n) for n in (0, 1, 2, 3, 32, 64, 512)] == [0, 0, 0, 2, 31, 62, 496]


def test_stager_makes_the_state_safe_before_the_trainer_arrives(make_segment, make_coordinator):
    seg = make_segment(specs=WIDE, cow_slots=96)
    at_step_n = seg.fill(seed=1)
    n = seg.layout.n_chunks
    coordinator = make_coordinator(max_bandwidth=400_000)  # ~1 s for the 384 KiB
    handle = coordinator.start(seg.source("job", 5, metadata_json=metadata_for(seg)))
    k = seg.header[Word.STAGE_SLOTS]
    assert k == stager_slot_count(seg.layout.cow_slots) == 93
    # A forward/backward's worth of time: the stager reaches every chunk, the writer few.
    _wait_for(lambda: seg.header[Word.STAGED_UPTO] == n)
    assert seg.header[Word.PERSISTED_UPTO] < n // 2
    trainer = Trainer(seg, first_step=6, n_steps=2)
    trainer.run()
    assert trainer.error is None and trainer.copies == 0
    status = handle.wait(20)
    _exact(seg, status, at_step_n)
    assert status.cow_copies == 0 and status.backpressure_waits == 0 and status.trainer_copied_bytes == 0
    assert status.server_staged_chunks >= n - k
    assert status.server_staged_bytes == 4096 * status.server_staged_chunks
    assert seg.tensors() == trainer.expected_final()


@pytest.mark.parametrize("stage_threads", [1, 3])
@pytest.mark.parametrize("cow_slots", [5, 3])
def test_a_ring_smaller_than_the_state_stays_exact(make_segment, make_coordinator, cow_slots, stage_threads):
    seg = make_segment(specs=WIDE, cow_slots=cow_slots)
    at_step_n = seg.fill(seed=2)
    coordinator = make_coordinator(max_bandwidth=800_000, stage_threads=stage_threads)
    handle = coordinator.start(seg.source("job", 5))
    trainer = Trainer(seg, first_step=6, n_steps=3)
    trainer.start()
    status = handle.wait(20)
    trainer.join(20)
    assert trainer.error is None
    _exact(seg, status, at_step_n)
    assert seg.tensors() == trainer.expected_final()
    assert status.server_staged_chunks > 0  # the ring moved on behind the writer
    assert status.cow_copies == trainer.copies
    assert status.trainer_copied_bytes == 4096 * status.cow_copies
    assert status.backpressure_waits > 0  # the memory rule: this budget cannot cover the state


def test_a_segment_without_slots_to_spare_is_the_trainer_only_protocol(make_segment, make_coordinator):
    seg = make_segment(specs=WIDE, cow_slots=2)  # stager_slot_count: none to spare below 3
    at_step_n = seg.fill(seed=3)
    coordinator = make_coordinator(max_bandwidth=800_000)
    handle = coordinator.start(seg.source("job", 5))
    assert seg.header[Word.STAGE_SLOTS] == 0
    trainer = Trainer(seg, first_step=6, n_steps=2)
    trainer.start()
    status = handle.wait(20)
    trainer.join(20)
    assert trainer.error is None
    _exact(seg, status, at_step_n)
    assert status.server_staged_chunks == 0 and status.cow_copies > 0


@pytest.mark.parametrize("into", ["slots", "file"])
def test_a_stager_copy_torn_by_the_trainer_loses_to_the_trainers_copy(make_segment, make_coordinator, monkeypatch,
                                                                      request, into):
    """The stager reads chunk c while the trainer, having copied c itself first (c was not yet
    staged), overwrites it: the stager's slot holds torn bytes, the trainer's slot wins. A memory-only
    snapshot's stager copies into the file itself: the writer writes the trainer's copy over the torn one."""
    memory_only = request.getfixturevalue("memory_only") if into == "file" else None
    seg = make_segment(specs=WIDE, cow_slots=8)
    at_step_n = seg.fill(seed=4)
    victim = seg.chunks[5]
    source_address = []
    real_memmove = snapshot_stager._posix.memmove
    done = {"torn": False}

    def memmove(dst, src, n):
        if not done["torn"] and source_address and src == source_address[0] + victim.offset:
            done["torn"] = True
            half = n // 2
            real_memmove(dst, src, half)  # the first half still holds step N ...
            protector = TrainerProtector(seg.mm, seg.layout, header=seg.header)
            assert protector.protect(victim)  # ... then the trainer copies and overwrites
            protector.close()
            seg.mm[victim.offset : victim.offset + victim.nbytes] = b"\xee" * victim.nbytes
            # A writer that did not follow the stager would pass the chunk meanwhile, and the torn rest land over it
            deadline = time.monotonic() + 1.0
            while into == "file" and seg.header[Word.PERSISTED_UPTO] <= victim.index and time.monotonic() < deadline:
                time.sleep(0.005)
            return real_memmove(dst + half, src + half, n - half)  # ... the rest is torn
        return real_memmove(dst, src, n)

    real_start = snapshot_stager.Stager.start

    def start(self, segment, places=None):
        source_address.append(snapshot_stager.buffer_address(segment))
        assert (places is not None) == (into == "file")
        real_start(self, segment, places)

    monkeypatch.setattr(snapshot_stager.Stager, "start", start)
    monkeypatch.setattr(snapshot_stager._posix, "memmove", memmove)
    coordinator = (memory_only[0] if memory_only else make_coordinator)(max_bandwidth=200_000)
    status = coordinator.start(dataclasses.replace(seg.source("job", 5), memory_only=bool(memory_only))).wait(20)
    assert done["torn"]
    if memory_only:  # the torn copy was in the file itself: the writer wrote the trainer's over it
        _memory_only_exact(seg, coordinator, status, memory_only[1], at_step_n)
    else:
        _exact(seg, status, at_step_n)
    assert status.cow_copies == 1 and status.trainer_copied_bytes == victim.nbytes
    assert seg.mm[victim.offset : victim.offset + 1] == b"\xee"  # the trainer's write stands


def test_a_memory_only_snapshot_staged_into_its_file_is_exact_while_the_trainer_steps(make_segment, memory_only):
    """The stager copies every chunk into this host's file, the writer follows it checksumming and sending; the
    trainer steps meanwhile, copying what the stager has not reached: both copies hold step N's bytes."""
    make, peer_dir = memory_only
    seg = make_segment(specs=WIDE, cow_slots=8)
    at_step_n = seg.fill(seed=10)
    coordinator = make(max_bandwidth=400_000)
    handle = coordinator.start(dataclasses.replace(seg.source("job", 5), memory_only=True))
    trainer = Trainer(seg, first_step=6, n_steps=3)
    trainer.start()
    status = handle.wait(20)
    trainer.join(20)
    assert trainer.error is None
    _memory_only_exact(seg, coordinator, status, peer_dir, at_step_n)
    assert seg.tensors() == trainer.expected_final()
    state = sum(t.nbytes for t in seg.layout.tensors)
    # No ring to wait for: each chunk staged, or copied by the trainer first (both, where the two raced)
    assert status.server_staged_bytes + status.trainer_copied_bytes >= state
    assert status.server_staged_bytes > 0


def test_a_chunk_staged_while_the_writer_reads_it_is_rewritten_from_the_stager_slot(
    make_segment, make_coordinator, monkeypatch
):
    """The writer reads chunk c from the segment; meanwhile the stager stages c and publishes
    it, so the trainer overwrites c without a copy of its own: the writer's check after its
    read sees ``STAGED_UPTO > c`` and rewrites the chunk from the stager's slot."""
    seg = make_segment(specs=WIDE, cow_slots=4)
    at_step_n = seg.fill(seed=5)
    victim = seg.chunks[7]
    k = stager_slot_count(seg.layout.cow_slots)
    monkeypatch.setattr(snapshot_stager.Stager, "_run", lambda self: self.idle.set())  # this test stages
    real_place = snapshot_writer._place
    done = {"raced": False}
    at_victim = bytes(seg.mm[victim.offset : victim.offset + victim.nbytes])

    def place(sink, data, stable):
        if not done["raced"] and seg.header[Word.PERSISTED_UPTO] == victim.index and bytes(data) == at_victim:
            done["raced"] = True
            slot = seg.layout.cow_slots_offset + (victim.index % k) * seg.layout.chunk_bytes
            seg.mm[slot : slot + victim.nbytes] = at_victim  # the stager's copy ...
            seg.header[Word.STAGED_UPTO] = victim.index + 1  # ... published
            protector = TrainerProtector(seg.mm, seg.layout, header=seg.header)
            assert not protector.protect(victim)  # safe: no copy
            protector.close()
            seg.mm[victim.offset : victim.offset + victim.nbytes] = b"\xdd" * victim.nbytes
            data = memoryview(seg.mm)[victim.offset : victim.offset + victim.nbytes]  # torn
        return real_place(sink, data, stable)

    monkeypatch.setattr(snapshot_writer, "_place", place)
    coordinator = make_coordinator()
    status = coordinator.start(seg.source("job", 5)).wait(20)
    assert done["raced"]
    _exact(seg, status, at_step_n)
    assert status.cow_copies == 0


def test_copy_budget_warning_at_snapshot_names_the_numbers(make_segment, make_coordinator, caplog):
    seg = make_segment(specs=WIDE, cow_slots=4)
    seg.fill(seed=6)
    coordinator = make_coordinator(copy_policy=CopyBudgetPolicy(assumed_bytes_per_s=100_000, fwd_bwd_s=0.5))
    budget = coordinator.copy_policy.budget(seg.layout)
    state = sum(t.nbytes for t in seg.layout.tensors)
    assert budget.needed_bytes == state - 50_000 and budget.slot_bytes == 4 * 4096
    assert budget.short_bytes == state - 50_000 - 4 * 4096
    with caplog.at_level(logging.WARNING, logger="swap_state.server.snapshot.coordinator"):
        status = coordinator.start(seg.source("job", 1)).wait(20)
    assert status.state is SnapshotState.DURABLE
    [fields] = [r.swap_state_fields for r in caplog.records if r.msg == "copy_budget_short"]
    assert (fields["state_bytes"], fields["slot_bytes"], fields["needed_bytes"]) == (state, 16384, state - 50_000)
    assert fields["assumed_fwd_bwd_s"] == 0.5 and fields["persist_measured"] is False
    assert f"short by {budget.short_bytes} bytes" in fields["detail"]
    # The snapshot measured the persist rate: the estimate uses it from now on.
    rate, measured = coordinator.copy_policy.rate()
    assert measured and rate > 0
    roomy = plan_segment(WIDE, 4096, 96)
    assert coordinator.copy_policy.budget(roomy).warning() == ""


def test_copy_budget_rule():
    ok = CopyBudget(state_bytes=1000, slot_bytes=600, persist_bytes_per_s=4000, persist_measured=True, fwd_bwd_s=0.1)
    assert ok.needed_bytes == 600 and ok.short_bytes == 0 and ok.warning() == ""
    short = CopyBudget(state_bytes=1000, slot_bytes=100, persist_bytes_per_s=4000, persist_measured=False,
                       fwd_bwd_s=0.1)
    assert short.short_bytes == 500
    assert "short by 500 bytes" in short.warning() and "(assumed)" in short.warning()


def test_stager_and_trainer_slots_never_overlap(make_segment, make_coordinator, monkeypatch):
    """Every slot the trainer takes is one of its own; the stager writes only its own."""
    seg = make_segment(specs=WIDE, cow_slots=6)
    seg.fill(seed=7)
    k = stager_slot_count(6)
    taken: list[int] = []
    real_free_slot = type(seg.header).free_slot

    def free_slot(header):
        slot = real_free_slot(header)
        if slot is not None:
            taken.append(slot)
        return slot

    monkeypatch.setattr(type(seg.header), "free_slot", free_slot)
    written: list[int] = []
    real_copy = snapshot_stager.Stager._copy

    def copy(self, chunks):
        written.extend(c.index % self.slots for c in chunks)
        return real_copy(self, chunks)

    monkeypatch.setattr(snapshot_stager.Stager, "_copy", copy)
    coordinator = make_coordinator(max_bandwidth=600_000)
    handle = coordinator.start(seg.source("job", 1))
    trainer = Trainer(seg, first_step=2, n_steps=2)
    trainer.start()
    status = handle.wait(20)
    trainer.join(20)
    assert trainer.error is None and status.state is SnapshotState.DURABLE
    assert taken and all(k <= j < 6 for j in taken)
    assert written and all(0 <= j < k for j in written)


def test_specs_of_the_default_kit_still_round_trip(make_segment, make_coordinator):
    """The mixed-dtype kit (an empty tensor, odd sizes) with the stager on."""
    seg = make_segment(specs=SPECS, cow_slots=8)
    at_step_n = seg.fill(seed=8)
    coordinator = make_coordinator(max_bandwidth=300_000)
    handle = coordinator.start(seg.source("job", 1))
    trainer = Trainer(seg, first_step=2, n_steps=2, before_step=lambda step: time.sleep(0.05))
    trainer.start()
    status = handle.wait(20)
    trainer.join(20)
    assert trainer.error is None
    _exact(seg, status, at_step_n)


def test_with_everything_staged_the_writer_pauses_for_the_trainers_step(make_segment, make_coordinator, monkeypatch):
    """Nothing is at risk any more: the writer persists between the trainer's steps, not
    during them (bounded: a step stuck for TRAINER_YIELD_MAX_S ends the pausing)."""
    monkeypatch.setattr(snapshot_writer, "TRAINER_YIELD_MAX_S", 1.5)
    seg = make_segment(specs=WIDE, cow_slots=96)
    at_step_n = seg.fill(seed=9)
    coordinator = make_coordinator(max_bandwidth=40_000)  # 0.1 s per 4 KiB chunk
    handle = coordinator.start(seg.source("job", 5))
    n = seg.layout.n_chunks
    # ~1 s of streaming first: the writer pauses for at most as long as it streamed.
    _wait_for(lambda: seg.header[Word.STAGED_UPTO] == n and seg.header[Word.PERSISTED_UPTO] >= 10)
    seg.header[Word.WRITING_STEP] = 6  # the trainer is in its optimizer step
    time.sleep(0.15)
    paused_at = seg.header[Word.PERSISTED_UPTO]
    time.sleep(0.3)
    assert seg.header[Word.PERSISTED_UPTO] == paused_at  # the writer waits for the step
    seg.header[Word.WRITING_STEP] = 0  # the step is done: the writer goes on
    coordinator._limiter.bytes_per_second = None
    _exact(seg, handle.wait(20), at_step_n)

    # A trainer stuck mid-step does not hold the snapshot for more than the bound.
    seg.fill(seed=10)
    at_step_n = seg.tensors()
    coordinator._limiter.bytes_per_second = 40_000
    handle = coordinator.start(seg.source("job", 6))
    _wait_for(lambda: seg.header[Word.STAGED_UPTO] == n and seg.header[Word.PERSISTED_UPTO] >= 6)
    seg.header[Word.WRITING_STEP] = 7  # killed mid-step: never cleared
    coordinator._limiter.bytes_per_second = None
    started = time.monotonic()
    status = handle.wait(20)
    assert time.monotonic() - started < 4
    _exact(seg, status, at_step_n)


def test_the_stager_starts_before_a_slow_file_opens(make_segment, make_coordinator):
    """A replica's file opens only once its peer answered (a connection, a handshake, a prepare):
    the stager does not wait for it, so the trainer's next step finds its chunks staged. Here the
    file opens only once the stager filled its ring (else the snapshot fails)."""
    seg = make_segment(specs=WIDE, cow_slots=96)
    at_step_n = seg.fill(seed=2)
    coordinator = make_coordinator()
    directory, n = coordinator.directory, seg.layout.n_chunks

    class SlowToOpen:
        root = directory.root

        def __getattr__(self, name):
            return getattr(directory, name)

        def open_file(self, target, name):
            deadline, ring = time.monotonic() + 10, min(n, seg.header[Word.STAGE_SLOTS])
            while seg.header[Word.STAGED_UPTO] < ring:
                if time.monotonic() > deadline:
                    raise OSError(f"{name} opened with {seg.header[Word.STAGED_UPTO]} of {ring} chunks staged")
                time.sleep(0.005)
            return directory.open_file(target, name)

    coordinator.tier = SlowToOpen()
    _exact(seg, coordinator.start(seg.source("job", 5, metadata_json=metadata_for(seg))).wait(20), at_step_n)
