"""The copy-budget warning (at allocation, in Stats) and the restore staging reservation."""

from __future__ import annotations

import logging

from swap_server_testkit import Trainer, descriptor, spec

from swap_state.proto import swap_state_pb2 as pb
from swap_state.server.copy_budget import CopyBudgetPolicy
from swap_state.server.memory.arena import Arena

CHUNK = 64 << 10
BIG = [("m.exp_avg", "float32", (64 * CHUNK // 4,))]  # 4 MiB: 64 chunks


def make_arena(shm_dir, total=32 << 20, cow=4 * CHUNK, policy=None) -> Arena:
    return Arena(shm_dir=shm_dir, total_bytes=total, cow_pool_bytes=cow, chunk_bytes=CHUNK, tag="cb1",
                 copy_policy=policy)


def _short_events(caplog):
    return [r.swap_state_fields for r in caplog.records if r.msg == "copy_budget_short"]


def test_allocation_warns_when_the_copy_slots_cannot_cover_one_forward_backward(shm_dir, caplog):
    caplog.set_level(logging.WARNING, logger="swap_state")
    # 10 MB/s x 0.1 s: 1 MB persisted meanwhile
    arena = make_arena(shm_dir, policy=CopyBudgetPolicy(assumed_bytes_per_s=10e6))
    seg = arena.create_segment("abc1", descriptor(BIG, 1))
    try:
        [fields] = _short_events(caplog)
        state = 4 << 20
        assert fields["state_bytes"] == state and fields["slot_bytes"] == 4 * CHUNK
        assert fields["needed_bytes"] == state - 1_000_000
        assert fields["assumed_fwd_bwd_s"] == arena.copy_policy.fwd_bwd_s
        assert "raise --cow-budget" in fields["detail"]
    finally:
        arena.free(seg)

    caplog.clear()
    roomy = make_arena(shm_dir, cow=64 * CHUNK, policy=CopyBudgetPolicy(assumed_bytes_per_s=10e6))
    seg = roomy.create_segment("abc2", descriptor(BIG, 1))
    try:
        assert _short_events(caplog) == []
        assert roomy.copy_policy.budget(seg.layout).warning() == ""
    finally:
        roomy.free(seg)


def test_restore_staging_is_taken_from_the_free_budget_and_given_back(shm_dir):
    arena = make_arena(shm_dir, total=16 << 20)
    free = arena.free_bytes
    with arena.reserve_staging(free - 4096) as granted:
        assert granted and arena.free_bytes == 4096 and arena.staging_bytes == free - 4096
        with arena.reserve_staging(8192) as second:
            assert not second and arena.free_bytes == 4096
    assert arena.free_bytes == free and arena.staging_bytes == 0


async def test_stats_carry_the_copy_budget_and_its_inputs(start, connect, tmp_path):
    # Capped at 1 MB/s, the writer persists 100 KB of the 4 MiB during a 0.1 s forward/backward.
    server = await start(snapshot_dir=tmp_path / "snapshots", cow_budget=2 * CHUNK, persist_max_bandwidth=1_000_000)
    stub = connect(server)
    trainer = Trainer(stub, job_id="cb")
    try:
        await trainer.attach()
        await trainer.keep_alive()
        await trainer.allocate([spec("m.exp_avg", (64 * CHUNK // 4,))])
        stats = await stub.Stats(pb.StatsRequest(), timeout=5)
        assert stats.stage_threads == 1 and stats.assumed_fwd_bwd_seconds > 0
        assert stats.persist_bytes_per_second == 1e6 and not stats.persist_bandwidth_measured
        [session] = stats.sessions
        assert session.copy_slot_bytes == 2 * CHUNK
        assert session.copy_budget_needed_bytes > session.copy_slot_bytes
        assert "copy budget short by" in session.copy_budget_warning
    finally:
        trainer.close()
