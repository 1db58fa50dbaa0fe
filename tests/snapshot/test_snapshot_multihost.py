"""One host of a multi-host job: the coordinator completes the snapshot of the ranks attached
to its server (local_world_size of them) and records which ranks its directory holds; restore
of a rank held by another host's server says so."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from snapshot_kit import metadata_for

from swap_state.client.export.snapshot import ExportError, export_snapshot
from swap_state.server.snapshot.restoring.restore import restore
from swap_state.server.snapshot.coordinator import SnapshotCoordinator, SnapshotState
from swap_state.server.snapshot.group import RankRun
from swap_state.common.segment import Word
from swap_state.common.snapshot_errors import SnapshotInvalid, SnapshotLayoutMismatch, SnapshotNotFoundError
from swap_state.common.snapshot_format import INDEX_NAME, SnapshotIndex, rank_data_name

WORLD = 4
LOCAL = (1, 2)  # this host's ranks


def _source(seg, rank, *, step=5, world_size=WORLD, local_world_size=len(LOCAL), metadata=None):
    return seg.source("job", step, rank=rank, world_size=world_size, local_world_size=local_world_size,
                      metadata_json=metadata if metadata is not None else metadata_for(seg, step=step))


@pytest.fixture
def host_snapshot(make_segment, make_coordinator):
    """job/step-5 of ranks 1 and 2 of a world_size-4 job; returns (coordinator, contents)."""
    coordinator = make_coordinator()
    contents, handles = {}, []
    for rank in LOCAL:
        seg = make_segment(f"r{rank}")
        contents[rank] = seg.fill(100 + rank)
        handles.append(coordinator.start(_source(seg, rank)))
    statuses = [h.wait(20) for h in handles]
    assert [s.state for s in statuses] == [SnapshotState.DURABLE] * 2, [s.error for s in statuses]
    return coordinator, contents


def test_local_ranks_make_the_snapshot_durable_and_it_records_them(host_snapshot):
    coordinator, _ = host_snapshot
    [info] = coordinator.local.list("job")
    assert (info.world_size, info.ranks, info.local_world_size) == (WORLD, LOCAL, 2)
    raw = json.loads((info.path / INDEX_NAME).read_bytes())
    assert (raw["world_size"], raw["ranks"], raw["local_world_size"]) == (WORLD, [1, 2], 2)
    assert sorted({f["rank"] for f in raw["files"]}) == [1, 2]
    assert sorted(p.name for p in info.path.iterdir()) == sorted(
        [INDEX_NAME] + [f"rank-0000{r}.{ext}" for r in LOCAL for ext in ("safetensors", "manifest.json")]
    )
    # The rank files keep the job's world size.
    manifest = coordinator.local.read_manifest(info, 2)
    assert (manifest.rank, manifest.world_size) == (2, WORLD)
    # A status answered from disk (another server on the same directory) says the same.
    reader = SnapshotCoordinator(coordinator.local.root, clean_stale=False)
    status = asyncio.run(reader.wait_status("job/step-5", 1))
    assert (status.state, status.world_size, status.local_world_size, status.ranks) == (
        SnapshotState.DURABLE, WORLD, 2, LOCAL,
    )
    assert (status.ranks_joined, status.ranks_persisted) == (2, 2)
    with pytest.raises(SnapshotNotFoundError, match="another host's server"):
        asyncio.run(reader.wait_status("job/step-5", 0))
    reader.close()


def test_restore_of_a_present_rank_works_and_of_another_hosts_rank_is_a_clear_error(
    host_snapshot, make_segment
):
    coordinator, contents = host_snapshot
    store = coordinator.local
    target = make_segment("target")
    target.fill(7)
    result = restore(store, "latest", target.mm, target.layout,
                     header=target.header, job_id="job", rank=2, world_size=WORLD)
    assert (result.snapshot_id, result.step) == ("job/step-5", 5)
    assert target.tensors() == contents[2]

    before = target.tensor_area()
    with pytest.raises(SnapshotNotFoundError) as caught:
        restore(store, "latest", target.mm, target.layout, header=target.header, job_id="job", rank=0, world_size=WORLD)
    message = str(caught.value)
    assert "holds ranks [1, 2] of world_size 4, not rank 0" in message
    assert "the snapshot of rank 0 is on another host's server" in message
    # The global world size must still match.
    with pytest.raises(SnapshotLayoutMismatch, match="world_size 4, this job has 2"):
        restore(store, "latest", target.mm, target.layout, header=target.header, job_id="job", rank=1, world_size=2)
    assert target.tensor_area() == before


def test_ranks_of_one_server_must_agree_and_not_exceed_local_world_size(make_segment, make_coordinator):
    coordinator = make_coordinator()
    segs = {rank: make_segment(f"r{rank}") for rank in (0, 1, 2)}
    for seg in segs.values():
        seg.fill(1)
    first = coordinator.start(_source(segs[1], 1))
    with pytest.raises(SnapshotInvalid, match="local_world_size 2 .*rank 0 attached with 3"):
        coordinator.start(_source(segs[0], 0, local_world_size=3))
    second = coordinator.start(_source(segs[2], 2))
    assert first.wait(20).state is SnapshotState.DURABLE and second.wait(20).state is SnapshotState.DURABLE
    # A third rank of the job on this server at a step still persisting would be one too many;
    # at a durable step it is refused as existing.
    third = _source(segs[0], 0, step=6)
    handles = [coordinator.start(third)]
    with pytest.raises(SnapshotInvalid, match=r"already has its local_world_size 2 ranks \[0, 1\]"):
        handles.append(coordinator.start(_source(segs[1], 1, step=6)))
        coordinator.start(_source(segs[2], 2, step=6))
    assert all(h.wait(20).state is SnapshotState.DURABLE for h in handles)
    assert coordinator.local.resolve("job/step-6").ranks == (0, 1)


def test_a_missing_local_rank_times_out_naming_local_world_size(make_segment, make_coordinator):
    coordinator = make_coordinator(assemble_timeout_s=0.3)
    seg = make_segment("r1")
    seg.fill(3)
    status = coordinator.start(_source(seg, 1)).wait(20)
    assert status.state is SnapshotState.FAILED
    assert "only ranks [1] of the 2 ranks expected on this server (local_world_size" in status.error
    assert coordinator.local.list("job") == []


def _runs(sessions: dict[int, tuple[str, int] | RankRun]):
    """``job_ranks`` for a coordinator: the ranks of "job" this server's registry holds, as ``sessions`` says now
    (a run: a session of this job's shape, world size 4 with 2 ranks here, at step 4)."""
    return lambda job_id: {rank: now if isinstance(now, RankRun) else RankRun(now, 4, (WORLD, 2))
                           for rank, now in sessions.items()} if job_id == "job" else {}


@pytest.mark.parametrize("fault", ["restarted", "ended"])
def test_a_group_fails_at_once_when_a_rank_it_waits_for_restarts_or_ends(make_segment, make_coordinator, fault):
    """Rank 1 was attached (run s1/1) when rank 2 began step 5; its trainer is killed and a new one
    attaches (s1/2), or its session ends: the old trainer never asks for step 5, a new one retrains.
    The group fails within seconds naming it, not at the 300 s assembly deadline (a restore waited
    on it)."""
    sessions = {1: ("s1", 1), 2: ("s2", 1)}
    coordinator = make_coordinator(job_ranks=_runs(sessions))
    seg = make_segment("r2")
    seg.fill(3)
    handle = coordinator.start(seg.source("job", 5, rank=2, world_size=WORLD, local_world_size=2,
                                          metadata_json=metadata_for(seg, step=5), session_id="s2", generation=1))
    assert handle.wait(1.5).state is SnapshotState.PERSISTING  # rank 1 is only slow: the group waits
    if fault == "restarted":
        sessions[1] = ("s1", 2)
    else:
        del sessions[1]
    status = handle.wait(20)
    assert status.state is SnapshotState.FAILED
    assert "rank 1 of job job restarted (a new trainer attached, or its session ended) before it snapshotted step 5" \
        in status.error
    assert coordinator.local.list("job") == []


def test_another_runs_leftover_session_neither_fails_a_group_nor_is_waited_for(make_segment, make_coordinator):
    """Rank 3's session here is an earlier run's (world size 2: the job was re-placed), kept for its
    --grace, at step 9: it is not this group's rank, though past its step; when its grace ends the
    group still waits for rank 1, which then completes it."""
    sessions = {1: ("s1", 1), 2: ("s2", 1), 3: RankRun(("old", 1), 9, (2, 2))}
    coordinator = make_coordinator(job_ranks=_runs(sessions))
    segs = {rank: make_segment(f"r{rank}") for rank in LOCAL}
    handles = [coordinator.start(segs[2].source("job", 5, rank=2, world_size=WORLD, local_world_size=2,
                                                metadata_json=metadata_for(segs[2], step=5), session_id="s2",
                                                generation=1))]
    assert handles[0].wait(1.5).state is SnapshotState.PERSISTING
    del sessions[3]
    assert handles[0].wait(1.5).state is SnapshotState.PERSISTING
    handles.append(coordinator.start(segs[1].source("job", 5, rank=1, world_size=WORLD, local_world_size=2,
                                                    metadata_json=metadata_for(segs[1], step=5), session_id="s1",
                                                    generation=1)))
    assert [h.wait(20).state for h in handles] == [SnapshotState.DURABLE] * 2


def test_a_restarted_ranks_retrained_step_starts_afresh_never_joining_the_old_files(make_segment, make_coordinator):
    """Both ranks' trainers restart after rank 2 alone began step 5, and retrain to step 5 faster
    than the group's check: the new rank 1 is not added to the old attempt (its bytes are another
    run's); that attempt fails, and the retrained step is a new one, durable with the new bytes."""
    sessions = {1: ("s1", 1), 2: ("s2", 1)}
    coordinator = make_coordinator(job_ranks=_runs(sessions))
    segs = {rank: make_segment(f"r{rank}") for rank in LOCAL}
    segs[2].fill(3)

    def source(rank):
        run = sessions[rank]
        return segs[rank].source("job", 5, rank=rank, world_size=WORLD, local_world_size=2, session_id=run[0],
                                 generation=run[1], metadata_json=metadata_for(segs[rank], step=5))

    old = coordinator.start(source(2))
    old.thread.join(20)  # rank 2's part is written; the group waits for rank 1
    sessions.update({1: ("s1", 2), 2: ("s2", 2)})
    contents = {rank: segs[rank].fill(50 + rank) for rank in LOCAL}
    for seg in segs.values():
        seg.header[Word.TRAINER_COMMITS] += 1  # retrained: commits since
    handles = [coordinator.start(source(rank)) for rank in LOCAL]
    assert "rank 1 of job job restarted" in old.wait(20).error
    assert [h.wait(20).state for h in handles] == [SnapshotState.DURABLE] * 2
    for rank in LOCAL:
        target = make_segment(f"target{rank}")
        restore(coordinator.local, "latest", target.mm, target.layout, header=target.header, job_id="job",
                rank=rank, world_size=WORLD)
        assert target.tensors() == contents[rank]


def test_local_world_size_one_completes_alone(make_segment, make_coordinator):
    coordinator = make_coordinator()
    seg = make_segment("r3")
    seg.fill(4)
    assert coordinator.start(_source(seg, 3, local_world_size=1)).wait(20).state is SnapshotState.DURABLE
    [info] = coordinator.local.list("job")
    assert (info.world_size, info.ranks) == (WORLD, (3,))


def test_index_without_local_world_size_still_reads_and_bad_ranks_are_refused():
    base = {
        "format": "swap-state-snapshot", "version": 1, "job_id": "j", "step": 1,
        "created_unix": 0.0, "files": [],
    }
    old = SnapshotIndex.from_json({**base, "world_size": 2, "ranks": [0, 1]})  # before this field
    assert (old.local_world_size, old.complete_job) == (2, True)
    part = SnapshotIndex.from_json({**base, "world_size": 4, "ranks": [2, 3], "local_world_size": 2})
    assert (part.local_world_size, part.complete_job) == (2, False)
    for ranks, local in (([], 0), ([3, 2], 2), ([2, 2], 2), ([2, 4], 2), ([2, 3], 3)):
        with pytest.raises(ValueError):
            SnapshotIndex.from_json({**base, "world_size": 4, "ranks": ranks, "local_world_size": local})


# -- export of one host's snapshot ------------------------------------------------------------

EXPORT_SPECS = [("w.exp_avg", "float32", (2, 4)), ("b.exp_avg", "float32", (4,))]


def _export_snapshot(make_segment, make_coordinator, *, sharded: bool):
    """Ranks 2 and 3 of 4 on this host: a replicated bias moment and, if ``sharded``, a row
    shard of an 8x4 weight moment (ranks 0 and 1 hold rows 0-3 on another host)."""
    coordinator = make_coordinator()
    bias = torch.arange(4, dtype=torch.float32)
    handles = []
    for rank in (2, 3):
        seg = make_segment(f"x{rank}", specs=EXPORT_SPECS)
        rows = torch.full((2, 4), float(rank))
        for tensor, value in zip(seg.layout.tensors, (rows, bias)):
            seg.mm[tensor.offset : tensor.offset + tensor.nbytes] = value.numpy().tobytes()
        w = {"fqn": "m.w", "key": "exp_avg"}
        if sharded:
            w.update(global_shape=[8, 4], global_offset=[2 * rank, 0])
        meta = json.dumps({"tensors": {"w.exp_avg": w, "b.exp_avg": {"fqn": "m.b", "key": "exp_avg"}},
                           "param_groups": {}, "steps": {"m.w": 3, "m.b": 3}})
        handles.append(coordinator.start(_source(seg, rank, step=3, metadata=meta)))
    assert all(h.wait(20).state is SnapshotState.DURABLE for h in handles)
    return coordinator.local.resolve("job/step-3").path, bias


def test_export_of_one_hosts_replicated_snapshot_exports_its_ranks(make_segment, make_coordinator, tmp_path):
    path, bias = _export_snapshot(make_segment, make_coordinator, sharded=False)
    result = export_snapshot(path, tmp_path / "out.pt")
    assert (result.ranks, result.world_size) == ((2, 3), 4)
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(state["state.m.b.exp_avg"], bias)
    assert torch.equal(state["state.m.w.exp_avg"], torch.full((2, 4), 2.0))  # lowest rank present
    assert float(state["state.m.w.step"]) == 3.0


def test_export_of_one_hosts_shards_says_the_rest_is_on_other_hosts(make_segment, make_coordinator, tmp_path):
    path, _ = _export_snapshot(make_segment, make_coordinator, sharded=True)
    with pytest.raises(ExportError) as caught:
        export_snapshot(path, tmp_path / "out.pt")
    message = str(caught.value)
    assert "state.m.w.exp_avg" in message and "ranks [2, 3] of world_size 4" in message
    assert "cover 16 of 32 elements" in message and "other hosts' servers" in message
    assert not (tmp_path / "out.pt").exists()
    assert rank_data_name(2) in {p.name for p in path.iterdir()}
