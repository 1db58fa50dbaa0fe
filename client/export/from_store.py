"""``swap-state export --snapshot-store URI``: a snapshot read from the snapshot store.

The store (a server's ``--snapshot-store``: ``s3://BUCKET/PREFIX``, ``file:///PATH`` or a path
every host mounts; layout in :mod:`swap_state.common.stored_snapshots`) holds each rank's data
file and manifest byte for byte as the server's local snapshot directory does. The export
downloads the ranks' files of one complete snapshot into a temporary directory laid out as a
local snapshot directory::

    <tmp>/<job>/step-<N:012d>/rank-XXXXX.safetensors, rank-XXXXX.manifest.json, snapshot.json

(``snapshot.json`` is the store's merged index of the ranks' markers, written last), then runs
the local export on it unchanged, which verifies everything once more. Every byte is verified
while it arrives: each file's size and crc32 against the index, each manifest against the
snapshot, each data file's safetensors header and every tensor's crc32 (a corrupt object
names the object and the tensor). Objects are read in blocks of
:data:`~swap_state.common.snapshot_reader.READ_BLOCK_BYTES`, never whole. The temporary
directory lies next to the output (same filesystem, the space the output needs anyway) and is
removed on every path out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator

from swap_state.client.export.errors import ExportError
from swap_state.common.checksum import crc32
from swap_state.common.errors import ConfigError
from swap_state.common.names import step_dir_name
from swap_state.common.object_store import (
    STORE_FLAG,
    ObjectStore,
    PosixObjectStore,
    open_store,
)
from swap_state.common.snapshot_errors import SnapshotCorrupt, SnapshotStoreUnavailable
from swap_state.common.snapshot_format import (
    INDEX_NAME,
    FileRecord,
    RankManifest,
    dumps_json,
    rank_manifest_name,
)
from swap_state.common.snapshot_reader import (
    READ_BLOCK_BYTES,
    RankFileVerifier,
    SnapshotInfo,
    parse_rank_manifest,
)
from swap_state.common.stored_snapshots import StoredSnapshots
from tqdm import tqdm

__all__ = ["DIR_FLAG", "STORE_FLAG", "STORE_TIMEOUT_S", "DownloadedSnapshot", "check_sources", "downloaded_snapshot"]

DIR_FLAG = "--snapshot-dir"
#: Seconds one request to the store may take, retries included (the server's default too).
STORE_TIMEOUT_S = 60.0


def check_sources(snapshot_dir: object, snapshot_store: object, *, required: str | None = None) -> None:
    """At most one of ``--snapshot-dir`` and ``--snapshot-store``; exactly one when
    ``required`` (what needs it, e.g. ``--format torchtitan``) is given."""
    if snapshot_dir is not None and snapshot_store is not None:
        raise ExportError(f"give one of {DIR_FLAG} and {STORE_FLAG}, not both")
    if required and snapshot_dir is None and snapshot_store is None:
        raise ExportError(
            f"{required} needs {DIR_FLAG} DIR (the server's local snapshot directory) or "
            f"{STORE_FLAG} URI (its snapshot store)"
        )


@dataclasses.dataclass(frozen=True)
class DownloadedSnapshot:
    """A snapshot of the store, downloaded and verified into a local snapshot root."""

    root: pathlib.Path
    """The temporary snapshot root (``--snapshot-dir`` of the local export)."""
    path: pathlib.Path
    """The snapshot's directory: ``<root>/<job>/step-<N:012d>``."""
    info: SnapshotInfo
    """The snapshot as the store lists it (``info.path`` is its URI)."""


def _one_line(text: object) -> str:
    """``text`` on one line, without the object named twice (``reading X failed: X: why``)."""
    return re.sub(r"reading (\S+) failed: \1: ", r"reading \1 failed: ", " ".join(str(text).split()))


def _open(uri: str, timeout_s: float) -> StoredSnapshots:
    try:
        store = open_store(uri, timeout_s)
    except ConfigError as exc:
        raise ExportError(_one_line(exc)) from None
    if isinstance(store, PosixObjectStore) and not store.root.is_dir():
        raise SnapshotStoreUnavailable(f"{STORE_FLAG} {uri}: {store.root} is not a directory")
    return StoredSnapshots(store)


def _snapshot_id(snapshot: str, uri: str) -> str:
    """``snapshot`` as an id: the store's own URI of a snapshot (``swap-state snapshots``
    prints those) is accepted too."""
    prefix = uri.rstrip("/") + "/"
    return snapshot.removeprefix(prefix)


@contextlib.contextmanager
def _reading(store: ObjectStore, key: str) -> Iterator[None]:
    """A store request: a missing object is SnapshotCorrupt (a complete snapshot lost a file),
    any other failure SnapshotStoreUnavailable; both name the object."""
    try:
        yield
    except FileNotFoundError:
        raise SnapshotCorrupt(f"{store.describe(key)} is missing from the store") from None
    except OSError as exc:
        raise SnapshotStoreUnavailable(f"reading {store.describe(key)} failed: {exc}") from None


class _Copy:
    """One object streamed into a local file, its size and crc32 checked against the index."""

    def __init__(self, stored: StoredSnapshots, info: SnapshotInfo, name: str, dest_dir: pathlib.Path, bar: tqdm):
        self.store = stored.store
        self.key = stored.key(info.job_id, info.step, name)
        self.where = info.path / name
        self.dest = dest_dir / name
        self.bar = bar
        record = info.index.file(name)
        if record is None:
            raise SnapshotCorrupt(f"the markers of {info.path} do not list {name}")
        self.record: FileRecord = record
        with _reading(self.store, self.key):
            size = self.store.size(self.key)
        if size is None:
            raise SnapshotCorrupt(f"{self.store.describe(self.key)} is missing from the store")
        if size != record.bytes:  # before reading a byte: a bad object may be huge
            raise SnapshotCorrupt(f"{self.where} is {size} bytes; the snapshot's index says {record.bytes}")

    def run(self, consume: Callable[[bytes], None], header_bytes: int = 0) -> None:
        """Copy the object, handing ``consume`` its bytes in order (the first block is the
        first ``header_bytes`` when given, so a verifier sees a whole header first)."""
        offset, value = 0, 0
        try:
            with open(self.dest, "wb") as file:
                while offset < self.record.bytes:
                    want = header_bytes if offset == 0 and header_bytes else READ_BLOCK_BYTES
                    with _reading(self.store, self.key):
                        block = self.store.get_range(self.key, offset, min(want, self.record.bytes - offset))
                    if not block:
                        raise SnapshotCorrupt(f"{self.where} ends at byte {offset} of {self.record.bytes}")
                    consume(block)
                    value = crc32(block, value)
                    file.write(block)
                    offset += len(block)
                    self.bar.update(len(block))
        except OSError as exc:  # the local side: the store's errors are SnapshotErrors by now
            raise ExportError(f"cannot write {self.dest}: {exc}") from None
        if value != self.record.crc32:
            raise SnapshotCorrupt(f"{self.where} does not match its checksum in the snapshot's index")


def _download_rank(stored: StoredSnapshots, info: SnapshotInfo, rank: int, dest: pathlib.Path, bar: tqdm) -> None:
    """The rank's manifest (checked against the snapshot), then its data file, every tensor
    verified as it arrives."""
    name = rank_manifest_name(rank)
    copy = _Copy(stored, info, name, dest, bar)
    raw = bytearray()
    copy.run(raw.extend)
    # the checksum again, then job, step, rank, world size and the data file's name
    manifest: RankManifest = parse_rank_manifest(info, rank, bytes(raw), copy.record, copy.where)
    verifier = RankFileVerifier(info, manifest)
    data = _Copy(stored, info, manifest.data_file, dest, bar)
    verifier.check_size(data.record.bytes)
    started = False

    def feed(block: bytes) -> None:
        nonlocal started
        if started:
            verifier.feed(block)
        else:
            verifier.check_header(block)
            started = True

    data.run(feed, header_bytes=len(verifier.header))
    verifier.finish()


def _download(stored: StoredSnapshots, snapshot: str, near: pathlib.Path, progress: bool | None) -> DownloadedSnapshot:
    """Resolve, then download into a fresh directory next to ``near`` (the caller removes
    ``root`` whatever happens: it is made before anything can fail)."""
    info = stored.resolve(_snapshot_id(snapshot, stored.uri))
    try:
        near.parent.mkdir(parents=True, exist_ok=True)
        root = pathlib.Path(tempfile.mkdtemp(prefix=f".{near.name}.from-store-", dir=near.parent))
    except OSError as exc:
        raise ExportError(f"cannot make the download's temporary directory in {near.parent}: {exc}") from None
    result = DownloadedSnapshot(root, root / info.job_id / step_dir_name(info.step), info)
    try:
        result.path.mkdir(parents=True)
        with tqdm(total=info.bytes, unit="B", unit_scale=True, desc=f"download {info.snapshot_id}", delay=1.0,
                  disable=False if progress else None if progress is None else True) as bar:
            for rank in info.ranks:
                _download_rank(stored, info, rank, result.path, bar)
        try:
            (result.path / INDEX_NAME).write_bytes(dumps_json(info.index.to_json()))  # last, as the server does
        except OSError as exc:
            raise ExportError(f"cannot write {result.path / INDEX_NAME}: {exc}") from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return result


@contextlib.contextmanager
def downloaded_snapshot(
    store_uri: str,
    snapshot: str | os.PathLike[str],
    near: str | os.PathLike[str],
    *,
    timeout_s: float = STORE_TIMEOUT_S,
    progress: bool | None = None,
) -> Iterator[DownloadedSnapshot]:
    """Download and verify the complete snapshot ``snapshot`` (an id such as ``run1/step-1000``
    or ``run1/latest``, or its URI in the store) of the store ``store_uri`` into a temporary
    directory beside ``near`` (the export's output); removed when the block ends, however it
    ends. A failing store raises SnapshotStoreUnavailable, one line naming the URI and the
    flag; a corrupt object SnapshotCorrupt naming the object (and the tensor)."""
    try:
        stored = _open(store_uri, timeout_s)
        download = _download(stored, os.fspath(snapshot), pathlib.Path(os.path.abspath(near)), progress)
    except SnapshotStoreUnavailable as exc:
        message = _one_line(exc)
        if not message.startswith(STORE_FLAG):
            message = f"{STORE_FLAG} {store_uri}: {message}"
        if store_uri.startswith("s3://"):
            message += " (endpoint and credentials come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)"
        raise SnapshotStoreUnavailable(message) from None
    try:
        yield download
    finally:
        shutil.rmtree(download.root, ignore_errors=True)
