"""Spare files of a directory in memory (memory-only snapshots, replicas): a removed step's data
files are written over by the next step's, cut to size, never while a restore reads them, and
held within their limit."""

from __future__ import annotations

import os

import pytest

from swap_state.common.addresses import parse_address
from swap_state.common.snapshot_errors import SnapshotCorruptError
from swap_state.common.snapshot_format import rank_data_name
from swap_state.server.snapshot.tiers.directory import SnapshotDirectory
from swap_state.server.snapshot.tiers.replica_receiver import ReplicaReceiver
from swap_state.server.snapshot.tiers.replica_wire import PeerCredentials, ReplicaRefused, connect_to_peer
from swap_state.server.snapshot.tiers.seam import StepPlan
from swap_state.server.snapshot.tiers.spares import SpareFiles, hold_for_reading


def _step(directory: SnapshotDirectory, step: int, data: bytes):
    """Step ``step`` of job "job" with one data file holding ``data``, written (not committed:
    discarding it removes it as retention does); (the step, its data file)."""
    target = directory.prepare(StepPlan("job", step, 1, (), "", keep=1))
    with directory.open_file(target, rank_data_name(0)) as sink:
        sink.write_all(data)
        sink.finish()
    return target, target.location / rank_data_name(0)


def _files(spares: SpareFiles) -> list[str]:
    return sorted(os.listdir(spares.folder))


def test_a_removed_steps_data_file_is_written_over_by_the_next_cut_to_its_size(tmp_path):
    directory = SnapshotDirectory(tmp_path / "memory")
    directory.create_root()
    directory.spares = SpareFiles(directory.root)
    first, path = _step(directory, 1, b"a" * 100_000)
    inode = os.stat(path).st_ino
    directory.discard(first)
    assert directory.spares.bytes == 100_000 and len(_files(directory.spares)) == 1
    _, second = _step(directory, 2, b"b" * 40_000)
    assert os.stat(second).st_ino == inode  # the same pages
    assert second.read_bytes() == b"b" * 40_000  # nothing of the longer file left
    assert directory.spares.bytes == 0 and _files(directory.spares) == []


def test_a_file_being_read_is_never_taken_and_a_taken_one_is_never_read(tmp_path):
    directory = SnapshotDirectory(tmp_path / "memory")
    directory.create_root()
    directory.spares = SpareFiles(directory.root)
    step, held = _step(directory, 1, b"x" * 8192)
    fd = os.open(held, os.O_RDONLY)
    try:
        hold_for_reading(fd, held)
        directory.discard(step)
        assert directory.spares.bytes == 0  # removed with its step instead
        assert os.pread(fd, 8192, 0) == b"x" * 8192  # the reader keeps its bytes
    finally:
        os.close(fd)
    step, taken = _step(directory, 2, b"y" * 4096)
    fd = os.open(taken, os.O_RDONLY)
    try:
        directory.discard(step)  # a spare now, to be written over
        with pytest.raises(SnapshotCorruptError, match="removed while being restored"):
            hold_for_reading(fd, taken)
    finally:
        os.close(fd)


@pytest.mark.parametrize("limit, kept", [(None, ["c"]), (250, ["b", "c"]), (0, [])])
def test_spares_stay_within_their_limit_oldest_dropped_first(tmp_path, limit, kept):
    """None: the last removal's files only; a byte limit: the newest that fit."""
    spares = SpareFiles(tmp_path, limit)
    sizes = {"a": 100, "b": 120, "c": 130}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(bytes(size))
        spares.keep([tmp_path / name])
    assert spares.bytes == sum(sizes[name] for name in kept)
    assert len(_files(spares)) == len(kept)
    assert not any((tmp_path / name).exists() for name in sizes)  # renamed away or removed
    spares.drop()
    assert spares.bytes == 0 and _files(spares) == []


SECRET = b"a-replica-secret-of-32-bytes-xyz"


@pytest.fixture
def peer(tmp_path):
    """``peer(spares={name: bytes}, spare_limit)``: (a replica receiver of 1 MiB, its directory, a connection to it)
    with those spare files."""
    made = []

    def make(spares: dict[str, int], spare_limit: int = 1 << 20):
        directory = SnapshotDirectory(tmp_path / "replicas")
        directory.create_root()
        directory.spares = SpareFiles(directory.root, spare_limit)
        for name, size in spares.items():
            (tmp_path / name).write_bytes(bytes(size))
            directory.spares.keep([tmp_path / name])
        receiver = ReplicaReceiver(parse_address("tcp://127.0.0.1:0"), PeerCredentials(SECRET), directory,
                                   size=1 << 20)
        port = receiver.start()
        made.append(receiver)
        conn = connect_to_peer(parse_address(f"tcp://127.0.0.1:{port}"), PeerCredentials(SECRET))
        made.append(conn)
        return receiver, directory, conn

    yield make
    for thing in reversed(made):
        thing.close()


def _prepare(conn, job_id: str, nbytes: int) -> dict:
    return conn.request({"op": "prepare", "job_id": job_id, "step": 1, "world_size": 1, "tenant": "", "keep": None,
                         "bytes": nbytes})


def test_a_peer_writes_a_replica_over_its_spare_files_instead_of_dropping_them(peer, tmp_path):
    """Spares count in --replica-size (they are memory) as the bytes of the replica that will be written over them:
    fresh pages cost their zeroing, so they are not dropped for it."""
    receiver, directory, conn = peer({"old": 600_000})
    spare = os.stat(directory.spares.folder / os.listdir(directory.spares.folder)[0]).st_ino
    assert receiver.held_bytes() == 600_000
    _prepare(conn, "job", 600_000)
    assert directory.spares.bytes == 600_000  # the replica's, to be written over
    conn.send({"op": "open", "name": rank_data_name(0)})
    conn.send_data(b"r" * 600_000)
    conn.request({"op": "end", "bytes": 600_000})
    [written] = directory.root.glob(f"job/*/{rank_data_name(0)}")
    assert os.stat(written).st_ino == spare and directory.spares.bytes == 0 and receiver.held_bytes() == 600_000


def test_a_replica_arriving_beside_another_counts_no_spare_as_its_own(peer):
    """Only a step arriving alone knows which spare its file takes: a second one counts every spare as memory."""
    receiver, directory, conn = peer({"old": 600_000})
    _prepare(conn, "job", 600_000)
    with pytest.raises(ReplicaRefused, match="--replica-size"):
        _prepare(conn, "other-job", 600_000)  # 1.2 MB however the spare is used: over the 1 MiB
    assert receiver.held_bytes() == 600_000  # the spare dropped trying; the first step's bytes held


@pytest.mark.parametrize("spares, left", [({"a": 500_000, "b": 600_000, "c": 400_000}, 600_000),
                                          ({"a": 300_000, "b": 300_000, "c": 300_000, "d": 300_000}, 300_000)])
def test_a_peer_drops_the_spares_its_replica_is_not_written_over_instead_of_refusing(peer, spares, left):
    """Spares past --replica-size never refuse a replica; the largest stays (the replica's file takes it), so the
    memory its data file ends up with stays within the budget, whichever size the spares have."""
    receiver, directory, conn = peer(spares, spare_limit=2 << 20)
    assert receiver.held_bytes() > receiver.size
    _prepare(conn, "job", 600_000)
    assert directory.spares.bytes == left and receiver.held_bytes() - min(left, 600_000) <= receiver.size
    conn.send({"op": "open", "name": rank_data_name(0)})
    conn.send_data(b"r" * 600_000)
    conn.request({"op": "end", "bytes": 600_000})
    assert directory.spares.bytes == 0 and receiver.held_bytes() == 600_000 <= receiver.size


def test_a_file_still_being_written_is_never_taken(tmp_path):
    """Another rank's failure discards the step while this rank still writes its file."""
    directory = SnapshotDirectory(tmp_path / "memory")
    directory.create_root()
    directory.spares = SpareFiles(directory.root)
    target = directory.prepare(StepPlan("job", 1, 2, (), "", keep=1))
    with directory.open_file(target, rank_data_name(0)) as sink:
        sink.write_all(b"z" * 4096)
        directory.discard(target)
        assert _files(directory.spares) == []


def _mapped_step(directory: SnapshotDirectory, step: int, data: bytes):
    """As :func:`_step`, the bytes copied into the sink's mapping (as a memory-only snapshot's stager does);
    (the step, its data file, the mapping)."""
    target = directory.prepare(StepPlan("job", step, 1, (), "", keep=1))
    with directory.open_file(target, rank_data_name(0)) as sink:
        sink.map(len(data))
        mapping = sink._mapped.obj
        mapping[:] = data
        with sink.put_mapped(len(data)) as placed:
            assert placed == data
        sink.advance()
        sink.finish()
    return target, target.location / rank_data_name(0), mapping


def test_a_files_mapping_is_kept_for_its_next_writer_and_let_go_once_the_file_is_removed(private_shm_dir):
    directory = SnapshotDirectory(os.path.join(private_shm_dir, "memory"))
    directory.create_root()
    directory.spares = SpareFiles(directory.root)
    first, path, mapping = _mapped_step(directory, 1, b"a" * 65536)
    directory.discard(first)  # its writer's mapping does not keep the file from being a spare
    assert directory.spares.bytes == 65536 and not mapping.closed
    second, path, again = _mapped_step(directory, 2, b"b" * 65536)
    assert again is mapping and path.read_bytes() == b"b" * 65536  # the same file, its pages mapped already
    directory.discard(second)
    _, path, third = _mapped_step(directory, 3, b"c" * 8192)  # another size: mapped anew
    assert third is not mapping and mapping.closed and path.read_bytes() == b"c" * 8192
    directory.spares.keep([path])
    directory.spares.drop()  # the file is gone: so is its mapping (its memory is freed)
    assert third.closed and directory.spares._mappings == {}


def test_a_file_removed_while_its_stager_copies_stays_mapped_until_its_sink_closes(private_shm_dir):
    """Another rank's failure discards the step while this rank's stager copies into the file: the spares let the
    mapping go, but it is unmapped only once the sink is closed (the stager's copies use its address)."""
    directory = SnapshotDirectory(os.path.join(private_shm_dir, "memory"))
    directory.create_root()
    directory.spares = SpareFiles(directory.root)
    target = directory.prepare(StepPlan("job", 1, 2, (), "", keep=1))
    with directory.open_file(target, rank_data_name(0)) as sink:
        sink.map(8192)
        mapping = sink._mapped.obj
        directory.discard(target)
        assert directory.spares._mappings == {} and not mapping.closed
        mapping[:] = b"s" * 8192  # where the stager would copy: still mapped


def test_a_file_that_does_not_fit_its_tmpfs_is_not_mapped(small_tmpfs):
    """Mapped without its blocks, a full tmpfs would kill the server (SIGBUS) at the stager's copy; it is refused at
    the map instead, and the write then fails the snapshot with ENOSPC."""
    directory = SnapshotDirectory(small_tmpfs / "memory")
    directory.create_root()
    directory.spares = SpareFiles(directory.root)
    target = directory.prepare(StepPlan("job", 1, 1, (), "", keep=1))
    with directory.open_file(target, rank_data_name(0)) as sink:
        assert sink.map(4 << 20) is None  # 4 MiB on a 1 MiB tmpfs
        with pytest.raises(OSError, match="No space left"):
            sink.write_all(bytes(4 << 20))
