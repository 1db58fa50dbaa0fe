"""What the store costs in requests, counted on a real directory store with the server's own
uploader: 64 ranks on 4 hosts upload two steps; a fresh server then finds ``latest``. The counts
are of :class:`ObjectStore` calls, each one S3 request (``get_range``: two, a HEAD and the GET;
a listing: one per thousand keys). Bars (the scale issue): an upload at most 10 requests per
rank, ``latest`` on a fresh server at most 20, neither growing with the number of ranks."""

from __future__ import annotations

import collections
import pathlib
import time

import pytest

from swap_state.common.checksum import crc32
from swap_state.common.object_store import PosixObjectStore
from swap_state.common.snapshot_format import (
    INDEX_NAME, LAYOUT_NAME, FileRecord, RankManifest, SnapshotIndex, TensorRecord, dumps_json, rank_data_name,
    rank_manifest_name, step_dir_name,
)
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.snapshot.layout_index import LayoutIndex
from swap_state.server.snapshot.reshard import TargetTensor
from swap_state.server.snapshot.store import SnapshotStore
from swap_state.server.snapshot.upload import SnapshotUploader, StoreState

JOB, HOSTS, RANKS_PER_HOST = "big", 4, 16
WORLD = HOSTS * RANKS_PER_HOST
S3_REQUESTS = {"get_range": 2}  # a HEAD for the size, then the GET; every other call is one


def _counted(name: str):
    """The directory store's ``name``, counted."""
    def call(self, *args, **kwargs):
        self.calls[name] += 1
        return getattr(PosixObjectStore, name)(self, *args, **kwargs)
    return call


class CountingStore(PosixObjectStore):
    """A directory store that counts its calls."""

    def __init__(self, root: pathlib.Path):
        super().__init__(root)
        self.calls: collections.Counter[str] = collections.Counter()

    def requests(self) -> int:
        return sum(n * S3_REQUESTS.get(name, 1) for name, n in self.calls.items())

    put = _counted("put")
    get_range = _counted("get_range")
    size = _counted("size")
    list = _counted("list")
    list_folders = _counted("list_folders")
    delete = _counted("delete")

    def get(self, key: str) -> bytes:  # one request (S3ObjectStore.get), not a size and a range
        self.calls["get"] += 1
        return PosixObjectStore.get_range(self, key, 0, 1 << 30)


def _manifest(rank: int, step: int) -> bytes:
    """A rank's manifest: its row of one tensor sharded over the job (the step's layout index
    is built from these)."""
    record = TensorRecord("w", "float32", (1,), 4, (0, 4), 0, global_shape=(WORLD,), global_offset=(rank,))
    return RankManifest(JOB, step, rank, WORLD, rank_data_name(rank), 64, 8, 4, (record,), {}, {}, {},
                        0, 0, 0.0, 0.0).to_bytes()


def _host_snapshot(root: pathlib.Path, host: int, step: int) -> SnapshotStore:
    """This host's ranks of the step, committed in its local snapshot directory (tiny files)."""
    ranks = range(host * RANKS_PER_HOST, (host + 1) * RANKS_PER_HOST)
    path = root / JOB / step_dir_name(step)
    path.mkdir(parents=True)
    files = []
    for rank in ranks:
        for name, body in ((rank_data_name(rank), b"d" * 64), (rank_manifest_name(rank), _manifest(rank, step))):
            (path / name).write_bytes(body)
            files.append(FileRecord(name, rank, len(body), crc32(body)))
    index = SnapshotIndex(JOB, step, WORLD, tuple(ranks), tuple(files), 1.0)
    (path / INDEX_NAME).write_bytes(dumps_json(index.to_json()))
    return SnapshotStore(root)


def _upload(uploader: SnapshotUploader, local: SnapshotStore, step: int) -> None:
    info = local.resolve(f"{JOB}/step-{step}")
    uploader.submit(info, 2)
    deadline = time.monotonic() + 60
    # Stored, then the step's index and retention: the worker is done with it when it no longer
    # holds the step.
    while any(uploader.status(JOB, step, r).state is StoreState.UPLOADING for r in info.ranks) or uploader.in_use(JOB):
        assert time.monotonic() < deadline, "upload still running after 60 s"
        time.sleep(0.01)
    assert {uploader.status(JOB, step, r).state for r in info.ranks} == {StoreState.STORED}


@pytest.mark.timeout(120)
def test_uploads_and_latest_cost_requests_that_do_not_grow_with_the_ranks(tmp_path):
    store = CountingStore(tmp_path / "store")
    hosts = [tmp_path / f"host{h}" for h in range(HOSTS)]
    uploaders = []
    for host, root in enumerate(hosts):
        local = _host_snapshot(root, host, 3)
        uploaders.append((SnapshotUploader(StoredSnapshots(store), local), local))
    try:
        for step in (3, 5):  # every host uploads its ranks of each step
            for host, (uploader, local) in enumerate(uploaders):
                if step == 5:
                    _host_snapshot(hosts[host], host, 5)
                _upload(uploader, local, step)
        per_rank = store.requests() / (2 * WORLD)
        assert per_rank <= 10, (per_rank, store.calls)
        # Data, manifest, marker per rank; the layout index and the index once per step, or by
        # each host that saw every marker (the uploaders started together, each resuming its
        # step 3), which reads every manifest for the layout index.
        assert 2 * (3 * WORLD + 2) <= store.calls["put"] <= 2 * (3 * WORLD + 2 * HOSTS), store.calls
        layout = StoredSnapshots(store).store.get(f"{JOB}/{step_dir_name(5)}/{LAYOUT_NAME}")
        assert LayoutIndex.from_bytes(layout, WORLD).plan(
            [TargetTensor("w", "float32", (WORLD,), (WORLD,), (0,))], target_rank=0, same_world=False
        )["w"][-1].source_rank == WORLD - 1

        for host in range(2):  # a third step, half uploaded: `latest` is still step 5
            _upload(uploaders[host][0], _host_snapshot(hosts[host], host, 7), 7)
    finally:
        for uploader, _ in uploaders:
            uploader.close()

    fresh = CountingStore(tmp_path / "store")
    latest = StoredSnapshots(fresh).resolve("latest", JOB)
    assert (latest.step, latest.world_size, len(latest.index.files)) == (5, WORLD, 2 * WORLD)
    assert fresh.requests() <= 20, fresh.calls  # a folder listing, the indexes, step 7's names
    assert fresh.calls["get"] <= 3, fresh.calls  # step 7's first marker, step 7's and 5's index
