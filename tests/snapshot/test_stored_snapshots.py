"""The store layer alone (common/object_store.py, common/stored_snapshots.py) on a real
directory: objects appear only whole, a step is complete only with every rank's marker, and
markers that do not belong are not trusted. (The servers, S3 and restores: the integration
tests in tests/integration/test_snapshot_store.py.)"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from swap_state.common.errors import ConfigError
from swap_state.common.object_store import PosixObjectStore, S3ObjectStore, open_store
from swap_state.common.snapshot_errors import SnapshotCorruptError, SnapshotNotFoundError
from swap_state.common.snapshot_format import (
    FileRecord, SnapshotIndex, TensorRecord, dumps_json, rank_data_name, rank_manifest_name)
from swap_state.common.stored_snapshots import StoredSnapshots, marker_name, parse_marker_name
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, layout_part
from swap_state.server.snapshot.restoring.restore import PlanSource, ReadSnapshot
from swap_state.server.snapshot.tiers.seam import StepPlan
from swap_state.server.snapshot.tiers.store import StoreTier

from bench.store_requests import JOB, CountingStore, host_snapshot
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.upload import SnapshotUploader, StoreState


def _marker(job: str, step: int, rank: int, world: int, *, files=None) -> bytes:
    files = files or (FileRecord(rank_data_name(rank), rank, 10, 1), FileRecord(rank_manifest_name(rank), rank, 5, 2))
    return dumps_json(SnapshotIndex(job, step, world, (rank,), tuple(files), 1.0).to_json())


def _put_rank(store, job: str, step: int, rank: int, world: int, **kw) -> None:
    prefix = StoredSnapshots.step_prefix(job, step)
    store.put(prefix + rank_data_name(rank), b"d" * 10)
    store.put(prefix + rank_manifest_name(rank), b"m" * 5)
    store.put(prefix + marker_name(rank), _marker(job, step, rank, world, **kw))


def test_an_object_appears_only_whole_and_an_aborted_put_leaves_nothing(tmp_path):
    store = PosixObjectStore(tmp_path)

    def failing():
        yield b"abc"
        raise ValueError("checksum mismatch")

    with pytest.raises(ValueError, match="checksum mismatch"):
        store.put("job/step-000000000001/x", failing())
    assert store.list("") == [] and store.size("job/step-000000000001/x") is None
    assert list(tmp_path.rglob("*.tmp-*")) == []  # the temporary went too
    store.put("job/a", [b"ab", memoryview(b"cd")])
    assert store.get("job/a") == b"abcd" and store.get_range("job/a", 1, 10) == b"bcd"
    store.delete("job/a")
    store.delete("job/a")  # gone already: no error
    assert not (tmp_path / "job").exists()  # emptied folders removed
    for bad in ("../x", "a//b", "/abs", ""):
        with pytest.raises(ValueError):
            store.put(bad, b"x")


def test_uris_name_their_store_and_a_bad_one_names_the_flag(tmp_path):
    assert isinstance(open_store(str(tmp_path)), PosixObjectStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path
    assert isinstance(open_store("s3://bucket/prefix"), S3ObjectStore)
    for bad in ("gs://bucket/x", "s3:///x", "file://host/x", ""):
        with pytest.raises(ConfigError, match="--snapshot-store"):
            open_store(bad)


def test_a_step_is_complete_only_with_every_ranks_marker(tmp_path):
    store = PosixObjectStore(tmp_path)
    stored = StoredSnapshots(store)
    for rank in (0, 2):
        _put_rank(store, "j", 5, rank, 3)  # rank 1 still uploading
    assert stored.list("j") == []
    with pytest.raises(SnapshotNotFoundError, match=str(tmp_path)):
        stored.resolve("latest", "j")
    _put_rank(store, "j", 5, 1, 3)
    _put_rank(store, "j", 3, 0, 1)
    [three, five] = stored.list("j")
    assert (three.step, three.latest, five.step, five.latest) == (3, False, 5, True)
    assert five.ranks == (0, 1, 2) and five.world_size == 3 and len(five.index.files) == 6
    assert str(five.path).endswith("j/step-000000000005")
    assert stored.resolve("latest", "j").step == 5 and stored.resolve("j/step-3").step == 3


def test_markers_that_do_not_belong_are_not_trusted(tmp_path):
    store = PosixObjectStore(tmp_path)
    stored = StoredSnapshots(store)
    _put_rank(store, "j", 1, 0, 2)
    prefix = StoredSnapshots.step_prefix("j", 1)
    store.put(prefix + marker_name(1), _marker("other", 1, 1, 2))  # another job's marker
    assert stored.list("j") == []
    store.put(prefix + marker_name(1), _marker("j", 1, 0, 2))  # names rank 0, sits as rank 1
    assert stored.list("j") == []
    store.put(prefix + marker_name(1), b"{not json")
    assert stored.list("j") == []
    store.put(prefix + marker_name(1), _marker("j", 1, 1, 3))  # another world size
    assert stored.list("j") == []
    store.put(prefix + marker_name(1), _marker("j", 1, 1, 2))
    assert [i.step for i in stored.list("j")] == [1]


def test_marker_names():
    assert marker_name(7) == "rank-00007.stored.json" and parse_marker_name("rank-00007.stored.json") == 7
    for other in ("rank-7.stored.json", "rank-00007.safetensors", "rank-0000x.stored.json"):
        assert parse_marker_name(other) is None


def test_markers_of_two_attempts_at_a_step_are_not_one_snapshot(tmp_path):
    store = PosixObjectStore(tmp_path)
    stored = StoredSnapshots(store)

    def attempt(rank: int, n: int) -> None:
        index = SnapshotIndex("j", 4, 2, (rank,), (FileRecord(rank_data_name(rank), rank, 10, n),
                                                    FileRecord(rank_manifest_name(rank), rank, 5, n)), 1.0, n)
        store.put(StoredSnapshots.step_prefix("j", 4) + marker_name(rank), dumps_json(index.to_json()))

    attempt(0, 1)
    attempt(1, 1)
    assert [i.index.attempt for i in stored.list("j")] == [1]
    attempt(0, 2)  # host a re-uploaded the step trained again; host b not yet
    assert stored.list("j") == []
    attempt(1, 2)
    assert [i.index.attempt for i in stored.list("j")] == [2]


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_create_makes_an_object_only_where_there_is_none(kind, tmp_path, request):
    store = PosixObjectStore(tmp_path) if kind == "posix" else S3ObjectStore(request.getfixturevalue("s3_store"))
    assert store.create("job/claim", b"first") is True
    assert store.create("job/claim", b"second") is False
    assert store.get("job/claim") == b"first"


def _record(rank: int, world: int) -> TensorRecord:
    return TensorRecord("w", "float32", (1,), 4, (0, 4), 7, global_shape=(world,), global_offset=(rank,))


def _put_host(store, job: str, step: int, rank: int, world: int, *, layout: bool = True) -> None:
    """A host of one rank as the uploader leaves it: the rank's objects, its marker, its part."""
    _put_rank(store, job, step, rank, world)
    files = (FileRecord(rank_data_name(rank), rank, 10, 1), FileRecord(rank_manifest_name(rank), rank, 5, 2))
    plan = StepPlan(job, step, world, (rank,), "", None, source=SnapshotIndex(job, step, world, (rank,), files, 1.0))
    StoreTier(StoredSnapshots(store)).put_part(plan, layout_part({rank: [_record(rank, world)]}) if layout else None)


class _HeldStore(CountingStore):
    """Counts its calls; reading a host part waits for ``go``."""

    def __init__(self, root):
        super().__init__(root)
        self.go = threading.Event()

    def get(self, key: str) -> bytes:
        if key.endswith(".part.json"):
            assert self.go.wait(30)
        return super().get(key)


@pytest.mark.timeout(60)
def test_of_two_hosts_that_see_every_part_one_reads_them_and_the_other_reads_nothing(tmp_path):
    """Host A sees every marker and part, claims the step and reads the parts (held here until
    host B is done); host B, listing the step meanwhile, sees every part and no index yet: it
    checks the claim before reading anything, and leaves the step to A."""
    for rank in range(2):
        _put_host(PosixObjectStore(tmp_path), "job", 4, rank, 2)
    a_store, b_store = _HeldStore(tmp_path), CountingStore(tmp_path)
    host_a = threading.Thread(target=StoreTier(StoredSnapshots(a_store)).publish_step_index, args=("job", 4, 1, 2))
    host_a.start()
    deadline = time.monotonic() + 30
    while b_store.size(StoredSnapshots.step_prefix("job", 4) + "publishing.attempt-1") is None:
        assert time.monotonic() < deadline, "host A never claimed the step"
        time.sleep(0.01)  # until A holds the claim
    b_store.calls.clear()
    assert StoreTier(StoredSnapshots(b_store)).publish_step_index("job", 4, 1, 2) is True
    assert b_store.calls == {"list": 1, "create": 1}, b_store.calls  # no marker, part or manifest read
    a_store.go.set()
    host_a.join(30)
    # A read the two parts and the one names object they share: no marker, no manifest.
    assert a_store.read == {"part": 2, "names": 1}, a_store.read
    index = StoredSnapshots(b_store).step_index("job", 4)
    assert index is not None and index.layout is not None and index.ranks == (0, 1)
    assert b_store.get(StoredSnapshots.step_prefix("job", 4) + "layout.json") == \
        LayoutIndex({r: [_record(r, 2)] for r in range(2)}, 2).to_bytes()
    assert index.files == StoredSnapshots(b_store).complete_info("job", 4, [
        o for o in b_store.list(StoredSnapshots.step_prefix("job", 4)) if not o.key.endswith("snapshot.json")]).index.files


def test_a_step_whose_part_goes_between_listing_and_reading_is_not_complete(tmp_path):
    """Retention (another host's, say) deletes a step while this host lists it: the part listed
    is gone when read, and the step is not complete, not an error for the whole listing."""
    store = PosixObjectStore(tmp_path)
    for step in (2, 4):
        for rank in range(2):
            _put_host(store, "job", step, rank, 2)
    stored = StoredSnapshots(store)
    listed = stored.list_step("job", 2)
    store.delete(next(o.key for o in listed if o.key.endswith(".part.json")))
    assert stored.complete_info("job", 2, listed) is None
    assert [info.step for info in stored.list("job")] == [4]


def test_a_step_missing_a_host_part_is_not_complete_and_costs_no_read(tmp_path):
    store = CountingStore(tmp_path)
    _put_host(store, "job", 4, 0, 2)
    _put_rank(store, "job", 4, 1, 2)  # rank 1's marker is there, its host's part not yet
    store.calls.clear()
    assert StoreTier(StoredSnapshots(store)).publish_step_index("job", 4, 1, 2) is False
    assert StoredSnapshots(store).list("job") == []
    # The names said it: no claim, and nothing read but the index looked for.
    assert store.calls["create"] == 0 and set(store.read) == {"index"}, (store.calls, store.read)


def test_a_step_before_host_parts_is_read_from_its_markers_and_says_so(tmp_path, caplog):
    store = CountingStore(tmp_path)
    for rank in range(3):
        _put_rank(store, "j", 5, rank, 3)
    with caplog.at_level(logging.WARNING):
        assert StoredSnapshots(store).resolve("latest", "j").step == 5
    assert store.read["marker"] == 3 and "no index and no host parts" in caplog.text and "3 markers" in caplog.text


def test_parts_without_a_layout_put_the_index_without_one_and_say_why(tmp_path, caplog):
    store = CountingStore(tmp_path)
    for rank in range(2):
        _put_host(store, "job", 4, rank, 2, layout=False)
    with caplog.at_level(logging.WARNING):
        assert StoreTier(StoredSnapshots(store)).publish_step_index("job", 4, 1, 2) is True
    index = StoredSnapshots(store).step_index("job", 4)
    assert index is not None and index.layout is None
    [record] = [r for r in caplog.records if r.msg == "store_layout_unbuilt"]
    assert "holds no part of the layout index" in record.swap_state_fields["error"]
    assert store.read["marker"] == store.read["manifest"] == 0


def test_a_step_not_yet_published_is_planned_from_its_parts_and_one_before_them_says_why(tmp_path, caplog):
    store = CountingStore(tmp_path)
    for rank in range(2):
        _put_host(store, "job", 4, rank, 2)
    stored = StoredSnapshots(store)
    with caplog.at_level(logging.INFO):
        read = ReadSnapshot(stored, stored.resolve("job/latest"))
    assert read.planned_from is PlanSource.LAYOUT_INDEX and "restore_layout_from_parts" in caplog.text
    assert read.index.to_bytes() == LayoutIndex({r: [_record(r, 2)] for r in range(2)}, 2).to_bytes()
    assert store.read["marker"] == store.read["manifest"] == 0, store.read  # parts and names only
    for rank in range(2):
        _put_rank(store, "old", 4, rank, 2)  # before host parts: no part, no index
    with caplog.at_level(logging.WARNING), pytest.raises(SnapshotCorruptError):  # its manifests are stubs here
        ReadSnapshot(stored, stored.resolve("old/latest"))
    [record] = [r for r in caplog.records if r.msg == "restore_every_manifest"]
    assert "host parts are missing" in record.swap_state_fields["detail"]


class _PartlessStore(CountingStore):
    """A store that refuses the hosts' parts (full, say, just after the markers went in)."""

    def open_writer(self, key: str):
        if key.endswith(".part.json"):
            raise OSError(28, "No space left on device")
        return super().open_writer(key)


@pytest.mark.timeout(60)
def test_a_host_part_not_put_fails_stored_and_a_restarted_server_puts_it(tmp_path):
    """The ranks count as stored only with their host's part (a step reads from the parts):
    a part the store refused fails the upload, and the next server on the directory resumes it."""
    local_root = tmp_path / "host"
    local = host_snapshot(local_root, 2, range(2), 3)
    uploader = SnapshotUploader(StoreTier(StoredSnapshots(_PartlessStore(tmp_path / "store"))), local)
    try:
        uploader.submit(local.reader.resolve(f"{JOB}/step-3"), None)
        deadline = time.monotonic() + 30
        while uploader.status(JOB, 3, 1).state is StoreState.UPLOADING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert uploader.status(JOB, 3, 1).state is StoreState.FAILED and "No space" in uploader.status(JOB, 3, 1).error
    finally:
        uploader.close()
    store = CountingStore(tmp_path / "store")
    assert StoredSnapshots(store).step_index(JOB, 3) is None
    resumed = SnapshotUploader(StoreTier(StoredSnapshots(store)), SnapshotDirectory(local_root))
    try:
        deadline = time.monotonic() + 30
        while StoredSnapshots(store).step_index(JOB, 3) is None:
            assert time.monotonic() < deadline, "the restarted server did not resume the upload"
            time.sleep(0.05)
    finally:
        resumed.close()
    prefix = StoredSnapshots.step_prefix(JOB, 3)
    assert store.size(prefix + "host-00000-00002-of-00002.part.json") and store.read["marker"] <= 2  # its own only
