"""What the store costs in requests, counted on a real directory store with the server's own
uploader (used by ``python -m bench.scale`` and ``tests/snapshot/test_store_requests.py``).

N ranks on N / ``ranks_per_host`` hosts, each host a :class:`SnapshotUploader` over its own
local snapshot directory (tiny files: one float of a tensor sharded over the job per rank),
upload two steps (3 and 5), then half of a third (7); a fresh reader then finds ``latest``.
The counts are of :class:`ObjectStore` calls, each one S3 request (``get_range``: two, a HEAD
and the GET; a listing: one per thousand keys, counted as one here).

The hosts finish one after the other, so one of them (the last) sees every marker and host part
and puts the step's layout index and index, reading every host's part (one per host) and each
distinct ``layout-names`` object once; no host reads another's markers or manifests. Of hosts that
finish at the same moment and each see every part, only the one that creates the step's claim
object reads anything (``tests/snapshot/test_stored_snapshots.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import time

from swap_state.common.checksum import crc32
from swap_state.common.object_store import PosixObjectStore
from swap_state.common.snapshot_format import (
    INDEX_NAME, FileRecord, RankManifest, SnapshotIndex, TensorRecord, dumps_json, rank_data_name,
    rank_manifest_name, step_dir_name,
)
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.store import StoreTier
from swap_state.server.snapshot.tiers.upload import SnapshotUploader, StoreState

JOB = "big"
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
        self.read: collections.Counter[str] = collections.Counter()  # objects read, by kind

    def requests(self) -> int:
        return sum(n * S3_REQUESTS.get(name, 1) for name, n in self.calls.items())

    def open_writer(self, key: str):  # every put, whole or in pieces: one request (an S3 PUT)
        self.calls["put"] += 1
        return PosixObjectStore.open_writer(self, key)

    create = _counted("create")
    size = _counted("size")
    list = _counted("list")
    list_folders = _counted("list_folders")
    delete = _counted("delete")

    def get(self, key: str) -> bytes:  # one request (S3ObjectStore.get), not a size and a range
        self.calls["get"] += 1
        self.read[_kind(key)] += 1
        return PosixObjectStore.get_range(self, key, 0, os.stat(self.local_path(key)).st_size)

    def get_range(self, key: str, offset: int, nbytes: int) -> bytes:
        self.calls["get_range"] += 1
        self.read[_kind(key)] += 1
        return PosixObjectStore.get_range(self, key, offset, nbytes)


def _kind(key: str) -> str:
    """What a read object is: marker, manifest, part, names, index, layout or data."""
    name = key.rsplit("/", 1)[-1]
    for suffix, kind in ((".stored.json", "marker"), (".manifest.json", "manifest"), (".part.json", "part"),
                         (".safetensors", "data"), ("snapshot.json", "index"), ("layout.json", "layout")):
        if name.endswith(suffix):
            return kind
    return "names" if name.startswith("layout-names.") else name


def rank_manifest(world: int, rank: int, step: int) -> bytes:
    """A rank's manifest: its row of one tensor sharded over the job (the step's layout index
    is built from these)."""
    record = TensorRecord("w", "float32", (1,), 4, (0, 4), 0, global_shape=(world,), global_offset=(rank,))
    return RankManifest(JOB, step, rank, world, rank_data_name(rank), 64, 8, 4, (record,), {}, {}, {},
                        0, 0, 0.0, 0.0).to_bytes()


def host_snapshot(root: pathlib.Path, world: int, ranks: range, step: int) -> SnapshotDirectory:
    """A host's ranks of the step, committed in its local snapshot directory (tiny files)."""
    path = root / JOB / step_dir_name(step)
    path.mkdir(parents=True)
    files = []
    for rank in ranks:
        for name, body in ((rank_data_name(rank), b"d" * 64), (rank_manifest_name(rank), rank_manifest(world, rank, step))):
            (path / name).write_bytes(body)
            files.append(FileRecord(name, rank, len(body), crc32(body)))
    index = SnapshotIndex(JOB, step, world, tuple(ranks), tuple(files), 1.0)
    (path / INDEX_NAME).write_bytes(dumps_json(index.to_json()))
    return SnapshotDirectory(root)


def upload(uploader: SnapshotUploader, local: SnapshotDirectory, step: int, timeout_s: float = 60) -> None:
    """Submit the host's step and wait until the worker is done with it (stored, then the step's
    index and retention: it no longer holds the step)."""
    info = local.reader.resolve(f"{JOB}/step-{step}")
    uploader.submit(info, 2)
    deadline = time.monotonic() + timeout_s
    while any(uploader.status(JOB, step, r).state is StoreState.UPLOADING for r in info.ranks) or uploader.in_use(JOB) \
            or not uploader.drain(0):
        if time.monotonic() > deadline:
            raise TimeoutError(f"upload of step {step} still running after {timeout_s} s")
        time.sleep(0.01)
    states = {uploader.status(JOB, step, r).state for r in info.ranks}
    if states != {StoreState.STORED}:
        raise RuntimeError(f"upload of step {step} ended {states}")


@dataclasses.dataclass
class Counted:
    """Requests of two steps' uploads (``upload``: a Counter, per kind) and of a fresh
    reader's ``latest`` (``latest``), with what ``latest`` found."""

    world: int
    upload: collections.Counter
    upload_requests: int
    latest: collections.Counter
    latest_requests: int
    latest_step: int
    store: CountingStore

    @property
    def upload_per_rank(self) -> float:
        return self.upload_requests / (2 * self.world)


def count_requests(root: pathlib.Path, world: int, ranks_per_host: int, timeout_s: float = 60) -> Counted:
    """Upload steps 3 and 5 from every host and half of step 7, then resolve ``latest`` from
    a fresh reader: the counted requests."""
    store = CountingStore(root / "store")
    hosts = [root / f"host{h}" for h in range(world // ranks_per_host)]
    ranks = [range(h * ranks_per_host, (h + 1) * ranks_per_host) for h in range(len(hosts))]
    # Uploaders started before their hosts' snapshots exist: none resumes one at start, so the
    # hosts finish one after the other and the last puts each step's indexes.
    locals_ = [SnapshotDirectory(r) for r in hosts]
    uploaders = [SnapshotUploader(StoreTier(StoredSnapshots(store)), local) for local in locals_]
    try:
        for step in (3, 5):  # every host uploads its ranks of each step
            for host, uploader in enumerate(uploaders):
                host_snapshot(hosts[host], world, ranks[host], step)
                upload(uploader, locals_[host], step, timeout_s)
        counted = collections.Counter(store.calls)
        requests = store.requests()
        for host in range(max(1, len(hosts) // 2)):  # a third step, half uploaded: `latest` is still 5
            upload(uploaders[host], host_snapshot(hosts[host], world, ranks[host], 7), 7, timeout_s)
    finally:
        for uploader in uploaders:
            uploader.close()
    fresh = CountingStore(root / "store")
    latest = StoredSnapshots(fresh).resolve("latest", JOB)
    return Counted(world, counted, requests, fresh.calls, fresh.requests(), latest.step, store)
