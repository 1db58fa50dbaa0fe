"""Sessions, segments and steps over a real grpc.aio server on a temporary Unix socket."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import grpc
import pytest
from swap_server_testkit import Trainer, spec, wait_until

from swap_state.client import cli
from swap_state.proto import swap_state_pb2 as pb
from swap_state.common.segment import MAGIC, PAGE_BYTES, SegmentHeader, Word, layout_hash
from swap_state.common.errors import NotFoundError
from swap_state.server.memory import sessions as sessions_mod
from swap_state.server.memory.session import FreedSession

TENSORS = [spec("layers.0.exp_avg", (1000, 33)), spec("layers.0.exp_avg_sq", (1000, 33)),
           spec("step", (), "int64")]


async def stats(stub) -> pb.StatsReply:
    return await stub.Stats(pb.StatsRequest(), timeout=10)


async def session_state(stub, session_id: str) -> str | None:
    for session in (await stats(stub)).sessions:
        if session.session_id == session_id:
            return session.state
    return None


async def test_attach_allocate_commit_roundtrip(server, stub, shm_dir):
    trainer = Trainer(stub, "llama-8b", rank=3, world_size=8)
    reply = await trainer.attach()
    assert reply.generation == 1 and not reply.reattached and not reply.has_segment
    assert reply.keepalive_interval_ms == 200
    assert await session_state(stub, trainer.session_id) == "pending"
    await trainer.keep_alive()
    assert await session_state(stub, trainer.session_id) == "live"

    alloc = await trainer.allocate(TENSORS)
    seg = alloc.segment
    assert not alloc.reused
    assert os.path.dirname(seg.path) == str(shm_dir)
    assert "llama" not in seg.path  # the name is built from server ids only
    info = os.stat(seg.path)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size > seg.size and info.st_size % PAGE_BYTES == 0  # then its descriptor
    assert info.st_blocks * 512 >= info.st_size  # committed (pre-faulted), not sparse
    assert seg.header_bytes % PAGE_BYTES == 0
    assert [t.name for t in seg.tensors] == [t.name for t in TENSORS]
    assert all(t.offset % PAGE_BYTES == 0 for t in seg.tensors)
    assert seg.tensors[0].nbytes == 1000 * 33 * 4 and seg.tensors[2].nbytes == 8
    assert seg.layout_hash == layout_hash([(t.name, t.dtype, tuple(t.shape)) for t in TENSORS])
    assert seg.chunk_bytes == 64 * 1024 and 0 < seg.cow_slots
    assert seg.cow_slots_offset + seg.cow_slots * seg.chunk_bytes == seg.size

    mapping = trainer.map()
    header = SegmentHeader(mapping)
    header.check()
    assert header[Word.MAGIC] == MAGIC and header[Word.N_TENSORS] == 3
    assert header[Word.COW_SLOTS] == seg.cow_slots
    assert header[Word.COMMITTED_STEP] == 0

    assert (await trainer.commit(0)).committed_step == 0
    assert (await trainer.commit(1)).committed_step == 1
    assert header[Word.COMMITTED_STEP] == 2  # step + 1, written by the server
    await trainer.commit(1)  # a retry of the same step is fine
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.commit(0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "backwards" in err.value.details()

    reply = await stats(stub)
    (session,) = reply.sessions
    assert (session.job_id, session.rank, session.world_size) == ("llama-8b", 3, 8)
    assert session.has_committed_step and session.last_committed_step == 1
    assert session.steps_committed == 2 and reply.steps_committed_total == 2
    assert reply.budget_used_bytes == os.stat(seg.path).st_size == session.segment_bytes
    assert reply.budget_total_bytes == 64 << 20
    header.release()
    trainer.close()


async def test_allocate_is_idempotent_for_the_same_layout_only(server, stub):
    trainer = Trainer(stub)
    await trainer.attach()
    first = await trainer.allocate(TENSORS)
    again = await trainer.allocate(TENSORS)
    assert again.reused and again.segment.path == first.segment.path
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.allocate([spec("other", (10,))])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (await stats(stub)).budget_used_bytes == os.stat(first.segment.path).st_size


async def test_commit_before_allocate_is_a_failed_precondition(server, stub):
    trainer = Trainer(stub)
    await trainer.attach()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.commit(0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Allocate" in err.value.details()


async def test_reattach_within_grace_gets_same_bytes_and_new_generation(start, connect):
    server = await start(grace=30)
    stub = connect(server)
    old = Trainer(stub, "job-a", rank=1, world_size=2)
    await old.attach()
    await old.keep_alive()
    seg = (await old.allocate(TENSORS)).segment
    payload = os.urandom(seg.tensors[0].nbytes)
    mapping = old.map()
    mapping[seg.tensors[0].offset : seg.tensors[0].offset + len(payload)] = payload
    await old.commit(41)
    old_generation = old.generation

    old.drop_keep_alive()  # the trainer "dies"
    await wait_until(lambda: session_state(stub, old.session_id), what="session visible")
    await wait_until(lambda: _is(session_state(stub, old.session_id), "orphaned"),
                     what="session orphaned")

    new = Trainer(connect(server), "job-a", rank=1, world_size=2)
    reply = await new.attach()
    assert reply.reattached and reply.has_segment
    assert reply.session_id == old.session_id
    assert reply.generation == old_generation + 1
    assert reply.segment.path == seg.path and reply.segment.layout_hash == seg.layout_hash
    assert reply.has_committed_step and reply.last_committed_step == 41
    await new.keep_alive()
    new_mapping = new.map()
    start_at = seg.tensors[0].offset
    assert new_mapping[start_at : start_at + len(payload)] == payload
    assert (await new.allocate(TENSORS)).reused

    # The stale trainer can neither commit nor keep the session alive.
    for call in (old.commit(42), old.stub.KeepAlive(
            pb.KeepAliveRequest(session_id=old.session_id, generation=old_generation)).read()):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stale generation" in err.value.details()

    # After a reattach the trainer may go back once (it restored an older checkpoint).
    await new.commit(40)
    with pytest.raises(grpc.aio.AioRpcError):
        await new.commit(39)
    mapping.close()
    new.close()


async def _is(awaitable, value) -> bool:
    return (await awaitable) == value


async def test_budget_returns_to_zero_after_detach_keep_and_grace(start, connect, shm_dir):
    server = await start(grace=0.3)
    stub = connect(server)
    trainer = Trainer(stub)
    await trainer.attach()
    await trainer.keep_alive()
    seg = (await trainer.allocate(TENSORS)).segment
    assert (await stats(stub)).budget_used_bytes == os.stat(seg.path).st_size
    await trainer.detach(keep=True)
    assert await session_state(stub, trainer.session_id) == "orphaned"
    assert (await stats(stub)).budget_used_bytes == os.stat(seg.path).st_size  # kept during the grace period

    async def freed() -> bool:
        reply = await stats(stub)
        return reply.budget_used_bytes == 0 and not reply.sessions

    await wait_until(freed, timeout=5, what="budget back to zero")
    reply = await stats(stub)
    assert reply.budget_free_bytes == server.arena.total_bytes - server.arena.cow_reserve_bytes
    assert not os.path.exists(seg.path) and os.listdir(shm_dir) == []
    # The kept session is gone: a new attach is a fresh session.
    again = await Trainer(stub).attach()
    assert not again.reattached and again.session_id != trainer.session_id
    trainer.close()


async def test_detach_without_keep_frees_immediately(server, stub):
    trainer = Trainer(stub)
    await trainer.attach()
    await trainer.keep_alive()
    seg = (await trainer.allocate(TENSORS)).segment
    await trainer.detach(keep=False)
    # The server ends the liveness stream with a notice.
    event = await asyncio.wait_for(trainer.keepalive_call.read(), 5)
    assert event.notice == "detached"
    reply = await stats(stub)
    assert reply.budget_used_bytes == 0 and not reply.sessions
    assert not os.path.exists(seg.path)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.commit(1)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    trainer.close()


async def test_session_that_never_opens_a_stream_is_freed(start, connect):
    server = await start(stream_wait=0.2, grace=0.2)
    stub = connect(server)
    trainer = Trainer(stub)
    await trainer.attach()
    await trainer.allocate(TENSORS)

    async def gone() -> bool:
        return (await stats(stub)).budget_used_bytes == 0

    await wait_until(gone, timeout=5, what="pending session freed")


async def test_live_session_is_not_taken_over(server, stub, connect):
    first = Trainer(stub, "job", rank=0, world_size=2)
    await first.attach()
    await first.keep_alive()
    intruder = Trainer(connect(server), "job", rank=0, world_size=2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await intruder.attach()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "live" in err.value.details()
    # Still the first trainer's session, and another rank of the job attaches fine.
    assert await session_state(stub, first.session_id) == "live"
    (session,) = (await stats(stub)).sessions
    assert session.generation == first.generation
    other = Trainer(stub, "job", rank=1, world_size=2)
    assert not (await other.attach()).reattached
    first.close()


async def test_reattach_with_another_world_size_replaces_the_kept_session(start, connect):
    server = await start(grace=30)
    stub = connect(server)
    old = Trainer(stub, "job", rank=0, world_size=2)
    await old.attach()
    await old.allocate(TENSORS)
    await old.detach(keep=True)
    new = Trainer(stub, "job", rank=0, world_size=4)
    reply = await new.attach()
    assert not reply.reattached and not reply.has_segment
    assert (await stats(stub)).budget_used_bytes == 0


async def test_eight_trainers_at_once(start, connect):
    server = await start(shm_size=256 << 20)
    trainers = [Trainer(connect(server), "job8", rank=r, world_size=8) for r in range(8)]

    async def run(trainer: Trainer) -> tuple[str, bytes]:
        await trainer.attach()
        await trainer.keep_alive()
        seg = (await trainer.allocate([spec("m", (256, 1024)), spec("v", (256, 1024))])).segment
        mapping = trainer.map()
        payload = bytes([trainer.rank + 1]) * 4096
        mapping[seg.tensors[1].offset : seg.tensors[1].offset + 4096] = payload
        for step in range(5):
            await trainer.commit(step)
        return seg.path, payload

    results = await asyncio.gather(*(run(t) for t in trainers))
    paths = {path for path, _ in results}
    assert len(paths) == 8
    reply = await stats(trainers[0].stub)
    assert sorted((s.rank, s.state, s.last_committed_step) for s in reply.sessions) == [
        (r, "live", 4) for r in range(8)
    ]
    assert reply.budget_used_bytes == sum(s.segment_bytes for s in reply.sessions)
    assert reply.steps_committed_total == 40
    for trainer, (path, payload) in zip(trainers, results):
        with open(path, "rb") as f:
            f.seek(trainer.segment.tensors[1].offset)
            assert f.read(4096) == payload
        trainer.close()


async def test_over_budget_is_resource_exhausted_with_numbers(start, connect):
    server = await start(shm_size=8 << 20, cow_budget=256 << 10)
    stub = connect(server)
    trainer = Trainer(stub)
    await trainer.attach()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.allocate([spec("big", (3 << 20,))])  # 12 MiB of float32
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = err.value.details()
    free = (8 << 20) - (256 << 10)
    assert "requested 12591104" in details  # one header page + 12 MiB + a descriptor page
    assert f"free {free}" in details and f"total {8 << 20}" in details
    assert (await stats(stub)).budget_used_bytes == 0
    fits = await trainer.allocate([spec("fits", (1 << 20,))])
    assert fits.segment.size > 4 << 20


async def test_cow_slots_come_out_of_the_pool_and_go_back(start, connect):
    server = await start(cow_budget=4 * 64 << 10)  # 4 slots of 64 KiB
    stub = connect(server)
    big = [spec("t", (4 * 64 << 10,), "uint8")]  # 4 chunks: wants as many slots as it can get
    first = Trainer(stub, "a")
    await first.attach()
    assert (await first.allocate(big)).segment.cow_slots == 4
    second = Trainer(stub, "b")
    await second.attach()
    assert (await second.allocate(big)).segment.cow_slots == 0  # pool spent; still allocates
    await first.detach()
    third = Trainer(stub, "c")
    await third.attach()
    assert (await third.allocate(big)).segment.cow_slots == 4
    assert server.arena.cow_slots_used == 4


async def test_stats_and_status_say_what_the_copy_pool_holds(start, connect, capsys):
    server = await start(shm_size=4 << 30, cow_budget=512 << 20, chunk_bytes=64 << 20)
    stub = connect(server)
    reply = await stats(stub)
    assert (reply.cow_pool_bytes, reply.cow_pool_used_bytes) == (512 << 20, 0)
    assert reply.budget_total_bytes - reply.budget_used_bytes - reply.budget_free_bytes == 512 << 20
    assert await asyncio.to_thread(cli.main, ["status", "--server", server.address]) == 0
    assert capsys.readouterr().out.startswith(
        "budget: used 0.000 GiB / 4.000 GiB (free 3.500 GiB; 0.500 GiB held for the "
        "copy-before-write pool (--cow-budget)); steps committed: 0\n"
    )


async def test_stats_count_the_pool_slots_sessions_hold_as_used(start, connect):
    server = await start(cow_budget=4 * 64 << 10)  # 4 slots of 64 KiB
    stub = connect(server)
    trainer = Trainer(stub)
    await trainer.attach()
    seg = (await trainer.allocate([spec("t", (4 * 64 << 10,), "uint8")])).segment
    reply = await stats(stub)
    slots = seg.cow_slots * seg.chunk_bytes
    assert slots and (reply.cow_pool_bytes, reply.cow_pool_used_bytes) == (4 * 64 << 10, slots)
    held = reply.budget_total_bytes - reply.budget_used_bytes - reply.budget_free_bytes
    assert held == reply.cow_pool_bytes - reply.cow_pool_used_bytes


def test_status_line_of_a_pool_partly_given_to_sessions_and_of_a_restore():
    gib = 1 << 30
    reply = pb.StatsReply(budget_total_bytes=4 * gib, budget_used_bytes=gib, budget_free_bytes=11 * gib // 4,
                          cow_pool_bytes=gib // 2, cow_pool_used_bytes=gib // 4)
    assert cli.budget_rest(reply) == (
        "free 2.750 GiB; 0.250 GiB held for the copy-before-write pool (--cow-budget), whose other "
        "0.250 GiB are sessions' copy slots (in used)"
    )
    reply.budget_free_bytes -= gib // 8  # a restore holds staged bytes while it runs
    assert cli.budget_rest(reply).endswith("; 0.125 GiB held by restores in progress")
    assert cli.budget_rest(pb.StatsReply(budget_total_bytes=gib, budget_free_bytes=gib)) == "free 1.000 GiB"
    small = pb.StatsReply(budget_total_bytes=gib, budget_used_bytes=(1 << 20) + (128 << 10),
                          budget_free_bytes=gib // 2 - (1 << 20), cow_pool_bytes=gib // 2,
                          cow_pool_used_bytes=128 << 10)  # a small model's small slots
    assert "0.500 GiB held for the copy-before-write pool (--cow-budget), whose other 128.0KiB " in (
        cli.budget_rest(small)
    )


async def test_a_trainer_after_the_grace_period_is_told_why_its_state_is_gone(start, connect):
    server = await start(grace=0.3)
    stub = connect(server)
    old = Trainer(stub, "gone", rank=1, world_size=2)
    await old.attach()
    await old.keep_alive()
    await old.allocate(TENSORS)
    await old.commit(12)
    old.drop_keep_alive()  # the trainer "dies", and nobody comes back within --grace
    await wait_until(lambda: _is(session_state(stub, old.session_id), None), what="session freed")

    with pytest.raises(grpc.aio.AioRpcError) as err:  # its old session id
        await old.commit(13)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    details = err.value.details()
    assert "the server freed the state of job gone rank 1 " in details
    assert "last committed step 12" in details and "--grace of 0.3 s" in details
    assert "(reason=grace_expired)" in details
    assert "restore a snapshot" in details and "a longer --grace" in details

    again = await Trainer(connect(server), "gone", rank=1, world_size=2).attach()
    assert not again.reattached
    assert "job gone rank 1" in again.previous_session and "reason=grace_expired" in again.previous_session
    other_rank = await Trainer(stub, "gone", rank=0, world_size=2).attach()
    assert other_rank.previous_session == ""  # nothing was freed for it


async def test_a_detached_session_is_remembered_as_detached(server, stub):
    trainer = Trainer(stub, "closed")
    await trainer.attach()
    await trainer.detach(keep=False)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.commit(1)
    assert "its trainer detached without keeping it (reason=detached)" in err.value.details()
    again = await Trainer(stub, "closed").attach()
    assert "reason=detached" in again.previous_session


async def test_the_record_of_freed_sessions_is_bounded(server, stub, monkeypatch):
    monkeypatch.setattr(sessions_mod, "MAX_FREED", 3)
    trainers = [Trainer(stub, "bounded", rank=rank, world_size=5) for rank in range(5)]
    for trainer in trainers:
        await trainer.attach()
        await trainer.detach(keep=False)
    registry = server.sessions
    assert registry.why_no_state("bounded", 1) == "" and "rank 4" in registry.why_no_state("bounded", 4)
    with pytest.raises(NotFoundError, match="never attached"):
        registry.lookup(trainers[1].session_id, 1)
    with pytest.raises(NotFoundError, match="reason=detached"):
        registry.lookup(trainers[2].session_id, 1)
    freed = FreedSession("s4", "j", 4, "grace_expired", 4.0, 5.0, None)
    assert "rank 4 8.0 s ago (session s4): no trainer reattached within the server's --grace of 5 s" in (
        freed.describe(12.0)
    )


async def test_snapshot_rpcs_without_snapshot_dir_name_the_flag(server, stub):
    calls = [
        stub.Snapshot(pb.SnapshotRequest(session_id="0" * 32, generation=1, step=0)),
        stub.SnapshotStatus(pb.SnapshotStatusRequest(snapshot_id="j/step-1")),
        stub.ListSnapshots(pb.ListSnapshotsRequest()),
        stub.Restore(pb.RestoreRequest(session_id="0" * 32, generation=1, snapshot_id="latest")),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--snapshot-dir" in err.value.details()


async def test_unexpected_error_is_internal_and_server_keeps_serving(server, stub, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated bug")

    trainer = Trainer(stub)
    await trainer.attach()
    await trainer.allocate(TENSORS)
    monkeypatch.setattr(server.sessions, "commit_step", boom)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.commit(0)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "ref " in err.value.details() and "simulated" not in err.value.details()
    assert any("simulated bug" in r.getMessage() or "simulated bug" in str(r.exc_info)
               for r in caplog.records)
    monkeypatch.undo()
    assert (await trainer.commit(0)).committed_step == 0


async def test_cancelled_allocate_still_lands_and_a_retry_reuses_it(server, stub, monkeypatch):
    original = server.arena.create_segment

    def slow_create(*args, **kwargs):
        time.sleep(0.6)
        return original(*args, **kwargs)

    monkeypatch.setattr(server.arena, "create_segment", slow_create)
    trainer = Trainer(stub)
    await trainer.attach()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Allocate(pb.AllocateRequest(session_id=trainer.session_id,
                                               generation=trainer.generation, tensors=TENSORS),
                            timeout=0.1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    retry = await trainer.allocate(TENSORS)
    assert retry.reused
    assert len(server.arena.segments) == 1
    assert server.arena.used_bytes == os.stat(retry.segment.path).st_size


async def test_stop_ends_streams_and_removes_segments_and_socket(start, connect, shm_dir):
    server = await start(free_segments_on_stop=True)
    trainer = Trainer(connect(server))
    await trainer.attach()
    await trainer.keep_alive()
    seg = (await trainer.allocate(TENSORS)).segment
    stopping = asyncio.create_task(server.stop(grace=2))
    notices = []
    while (event := await asyncio.wait_for(trainer.keepalive_call.read(), 5)) is not grpc.aio.EOF:
        notices.append(event.notice)
    await stopping
    assert notices[-1] == "shutting down"
    assert not os.path.exists(seg.path) and os.listdir(shm_dir) == []
    assert server.socket_path is not None and not server.socket_path.exists()
    assert server.arena.used_bytes == 0
