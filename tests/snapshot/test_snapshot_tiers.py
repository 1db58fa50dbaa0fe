"""Which tier a restore reads (server/snapshot/tiers.py): this server's --snapshot-dir when it
holds the rank at the job's world size (or every rank), else the store; ``latest`` is the newest
step complete for the whole job, read here when this host has the same attempt of it."""

from __future__ import annotations

import pytest

from swap_state.common.object_store import PosixObjectStore
from swap_state.common.snapshot_errors import SnapshotNotFoundError, StoreUnavailableError
from swap_state.common.snapshot_format import FileRecord, SnapshotIndex, dumps_json, rank_data_name, rank_manifest_name
from swap_state.common.stored_snapshots import StoredSnapshots, marker_name
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.server.snapshot.restoring.tier_choice import resolve_source

JOB, WORLD = "j", 4


def _files(ranks):
    return tuple(FileRecord(name(r), r, 1, 0) for r in ranks for name in (rank_data_name, rank_manifest_name))


def _local(root, step: int, ranks, attempt: int = 1) -> None:
    path = root / JOB / f"step-{step:012d}"
    path.mkdir(parents=True)
    index = SnapshotIndex(JOB, step, WORLD, tuple(ranks), _files(ranks), 1.0, attempt)
    (path / "snapshot.json").write_bytes(dumps_json(index.to_json()))


def _stored(store, step: int, attempt: int = 1) -> None:
    for rank in range(WORLD):
        index = SnapshotIndex(JOB, step, WORLD, (rank,), _files([rank]), 1.0, attempt)
        store.put(StoredSnapshots.step_prefix(JOB, step) + marker_name(rank), dumps_json(index.to_json()))


@pytest.fixture
def tiers(tmp_path):
    local = SnapshotReader(tmp_path / "local")
    store = PosixObjectStore(tmp_path / "store")
    store.create_root()  # as the server does at start
    return local, store, StoredSnapshots(store)


def _where(local, stored, snapshot_id, rank=2, world=WORLD):
    tier, info = resolve_source(local, stored, snapshot_id, JOB, rank, world)
    return info.step, tier.where


def test_a_host_reads_its_own_ranks_here_and_a_lost_hosts_from_the_store(tiers):
    local, store, stored = tiers
    _local(local.root, 5, [2, 3])  # this host: ranks 2, 3
    _stored(store, 5)
    assert _where(local, stored, "j/step-5", rank=2) == (5, "local")
    assert _where(local, stored, "j/step-5", rank=0) == (5, "store")  # another host's rank
    assert _where(local, stored, "j/step-5", rank=0, world=2) == (5, "store")  # resharded: every rank needed
    assert _where(local, None, "j/step-5", rank=2) == (5, "local")  # no store: as before


def test_latest_is_the_newest_step_complete_for_the_job(tiers):
    local, store, stored = tiers
    _local(local.root, 3, [2, 3])
    _local(local.root, 6, [2, 3])  # this host's step 6; its other hosts' ranks never reached the store
    _stored(store, 3)
    assert _where(local, stored, "latest") == (3, "local")  # this host's copy of the job's step 3
    _stored(store, 3, attempt=2)  # the job trained step 3 again; this host's copy is the old attempt
    assert _where(local, stored, "latest") == (3, "store")
    _stored(store, 6)
    assert _where(local, stored, "latest") == (6, "local")


def test_a_whole_local_snapshot_newer_than_the_store_wins_latest(tiers):
    local, store, stored = tiers
    _local(local.root, 8, range(WORLD))  # a single-host job: every rank here
    _stored(store, 5)
    assert _where(local, stored, "latest") == (8, "local")


def test_nothing_anywhere_and_an_unreachable_store(tiers, tmp_path):
    local, store, stored = tiers
    with pytest.raises(SnapshotNotFoundError, match="--snapshot-dir"):
        resolve_source(local, stored, "latest", JOB, 0, WORLD)

    class Unreachable(PosixObjectStore):
        def list(self, prefix):
            raise OSError("connection refused")

        list_folders = list

    down = StoredSnapshots(Unreachable(tmp_path / "store", "s3://down/x"))
    _local(local.root, 4, [2, 3])
    assert resolve_source(local, down, "j/step-4", JOB, 2, WORLD)[1].step == 4  # its own rank: read here
    # 'latest' is not this host's newest while the store, which may hold a newer step, is unread.
    with pytest.raises(StoreUnavailableError, match=r"s3://down/x.*'latest' cannot be resolved.*restore j/step-4"):
        resolve_source(local, down, "latest", JOB, 2, WORLD)
    with pytest.raises(StoreUnavailableError, match="s3://down/x"):
        resolve_source(local, down, "j/step-4", JOB, 0, WORLD)  # another host's rank: only the store has it


def test_a_store_whose_root_is_gone_is_unreachable_not_empty(tiers, tmp_path):
    local, store, stored = tiers
    _stored(store, 5)
    assert [i.step for i in stored.list(JOB)] == [5]
    (tmp_path / "store").rename(tmp_path / "away")
    for broken in ("missing", "a file"):
        if broken == "a file":
            (tmp_path / "store").write_text("x")
        for read in (lambda: stored.list(JOB), lambda: stored.list(), lambda: stored.steps(JOB),
                     lambda: stored.step_index(JOB, 5)):
            with pytest.raises(StoreUnavailableError, match="root .* (does not exist|is not a directory)"):
                read()
        with pytest.raises(OSError, match="unreachable"):
            store.put("j/x", b"1")  # never a new root on the disk under an unmounted filesystem
    assert not (tmp_path / "store").is_dir()
