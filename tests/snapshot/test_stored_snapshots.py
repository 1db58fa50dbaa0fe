"""The store layer alone (common/object_store.py, common/stored_snapshots.py) on a real
directory: objects appear only whole, a step is complete only with every rank's marker, and
markers that do not belong are not trusted. (The servers, S3 and restores: the integration
tests in tests/integration/test_snapshot_store.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from swap_state.common.errors import ConfigError
from swap_state.common.object_store import PosixObjectStore, S3ObjectStore, open_store
from swap_state.common.snapshot_errors import SnapshotNotFoundError
from swap_state.common.snapshot_format import FileRecord, SnapshotIndex, dumps_json, rank_data_name, rank_manifest_name
from swap_state.common.stored_snapshots import StoredSnapshots, marker_name, parse_marker_name
from swap_state.server.snapshot.tiers.store import StoreTier


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


@pytest.mark.timeout(60)
def test_of_two_hosts_that_see_every_marker_one_builds_the_layout_index(tmp_path):
    """Host A sees every marker and builds the layout index (blocked here until host B is
    done); host B, listing the step meanwhile, sees every marker and no index yet: it leaves
    the step to A instead of reading every manifest too."""
    store = PosixObjectStore(tmp_path)
    for rank in range(2):
        _put_rank(store, "job", 4, rank, 2)
    b_done, built = threading.Event(), []

    def layout_a(info):
        assert b_done.wait(30)
        built.append("a")
        return b"{}"

    def layout_b(info):
        built.append("b")
        return b"{}"

    host_a = threading.Thread(target=StoreTier(StoredSnapshots(store)).publish_step_index, args=("job", 4, layout_a))
    host_a.start()
    deadline = time.monotonic() + 30
    while store.size(StoredSnapshots.step_prefix("job", 4) + "publishing.attempt-1") is None:
        assert time.monotonic() < deadline, "host A never claimed the step"
        time.sleep(0.01)  # until A holds the claim
    assert StoreTier(StoredSnapshots(store)).publish_step_index("job", 4, layout_b) is True
    b_done.set()
    host_a.join(30)
    assert built == ["a"]
    index = StoredSnapshots(store).step_index("job", 4)
    assert index is not None and index.layout is not None and index.layout.bytes == 2
