"""Adoption without gRPC: a new arena on the segments an old one (same tag) left. What passes
every check is adopted and charged; what fails one is left where it is, with the reason."""

from __future__ import annotations

import os

from swap_state.common.segment import Word, layout_hash
from swap_state.common.segment_descriptor import SegmentDescriptor
from swap_state.server.memory.adopt import adopt_segments
from swap_state.server.memory.arena import Arena
from swap_state.server.rpc.validation import validate_descriptor

CHUNK = 64 << 10
SPECS = [("state.w.exp_avg", "float32", (256, 64)), ("state.w.exp_avg_sq", "float32", (256, 64))]


def _arena(shm_dir, total=16 << 20, cow=4 * CHUNK) -> Arena:
    return Arena(shm_dir=shm_dir, total_bytes=total, cow_pool_bytes=cow, chunk_bytes=CHUNK,
                 tag="ad0pt", mlock=False)


def _descriptor(job: str = "j", rank: int = 0, specs=SPECS) -> SegmentDescriptor:
    return SegmentDescriptor(job, rank, 2, 2, tuple(specs), layout_hash(specs))


def _validate(descriptor: SegmentDescriptor):
    return validate_descriptor(descriptor, max_tensors=1024)


def _leave(arena: Arena) -> None:
    """What a killed server leaves: the files, nothing unmapped or unlinked by it."""
    for segment in arena.segments:
        segment._unmap()


def test_the_segments_an_old_server_left_are_adopted_with_their_bytes_and_charge(shm_dir):
    old = _arena(shm_dir)
    first = old.create_segment("a" * 32, _descriptor(rank=0))
    second = old.create_segment("b" * 32, _descriptor(rank=1))
    first.buffer[first.layout.tensors[0].offset] = 7
    first.header[Word.TRAINER_GENERATION] = 3
    first.header[Word.SNAP_EPOCH] = 9  # the old server died mid-snapshot
    used = old.used_bytes
    _leave(old)

    new = _arena(shm_dir)
    adopted, refused = adopt_segments(new, _validate)
    assert refused == []
    by_rank = {a.descriptor.rank: a for a in adopted}
    assert sorted(by_rank) == [0, 1] and new.used_bytes == used
    mine = by_rank[0]
    assert (mine.session_id, mine.generation, mine.open_epoch) == ("a" * 32, 3, 9)
    assert mine.segment.header[Word.SNAP_EPOCH] == 0  # that snapshot died with its server
    assert mine.segment.buffer[mine.segment.layout.tensors[0].offset] == 7
    assert by_rank[1].segment.path == second.path
    new.close()
    assert not os.listdir(shm_dir)


def test_an_older_segment_of_the_same_rank_is_superseded_and_freed(shm_dir):
    old = _arena(shm_dir)
    stale = old.create_segment("a" * 32, _descriptor())
    current = old.create_segment("b" * 32, _descriptor())
    _leave(old)
    new = _arena(shm_dir)
    adopted, refused = adopt_segments(new, _validate)
    assert [a.segment.path for a in adopted] == [current.path] and refused == []
    assert not stale.path.exists() and new.used_bytes == os.path.getsize(current.path)
    new.close(keep=[adopted[0].segment])
    assert current.path.exists()  # kept for the next server


def test_what_does_not_pass_a_check_is_refused_with_the_reason_and_left(shm_dir):
    old = _arena(shm_dir)
    plain = old.create_segment("a" * 32, _descriptor(rank=0))
    plain.header[Word.DESCRIPTOR_BYTES] = 0  # no descriptor: never adopted
    other_version = old.create_segment("b" * 32, _descriptor(rank=1))
    other_version.header[Word.VERSION] = 3
    wrong_hash = old.create_segment("c" * 32, _descriptor("k"))
    wrong_hash.header[Word.LAYOUT_HASH] ^= 1
    _leave(old)
    small = _arena(shm_dir, total=1 << 20, cow=4 * CHUNK)  # a smaller budget than its creator's
    adopted, refused = adopt_segments(small, _validate)
    reasons = {os.path.basename(r.path).split(".")[2][0]: r.reason for r in refused}
    assert "descriptor of 0 bytes" in reasons["a"]
    assert "layout version 3, this server reads 4" in reasons["b"]
    assert "layout hash does not match" in reasons["c"]
    assert adopted == [] and small.used_bytes == 0
    assert all(path.exists() for path in (plain.path, other_version.path, wrong_hash.path))


def test_a_budget_too_small_for_a_segment_refuses_it_naming_the_flags(shm_dir):
    old = _arena(shm_dir, total=64 << 20)
    specs = [("state.w.exp_avg", "float32", (1024, 1024))]
    big = old.create_segment("a" * 32, _descriptor(specs=specs))
    _leave(old)
    adopted, refused = adopt_segments(_arena(shm_dir, total=2 << 20), _validate)
    assert adopted == [] and len(refused) == 1
    assert "--shm-size and --cow-budget" in refused[0].reason and big.path.exists()
