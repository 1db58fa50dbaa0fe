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
from swap_state.server.snapshot.tiers.replica_wire import PeerCredentials, connect_to_peer
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


def test_a_peer_drops_its_spare_files_to_make_room_instead_of_refusing(tmp_path):
    """Spares count in --replica-size (they are memory) but never refuse a replica: they go first."""
    secret = b"a-replica-secret-of-32-bytes-xyz"
    directory = SnapshotDirectory(tmp_path / "replicas")
    directory.create_root()
    directory.spares = SpareFiles(directory.root, 1 << 20)
    (tmp_path / "old").write_bytes(bytes(600_000))
    directory.spares.keep([tmp_path / "old"])
    receiver = ReplicaReceiver(parse_address("tcp://127.0.0.1:0"), PeerCredentials(secret), directory, size=1 << 20)
    port = receiver.start()
    conn = connect_to_peer(parse_address(f"tcp://127.0.0.1:{port}"), PeerCredentials(secret))
    try:
        assert receiver.held_bytes() == 600_000
        conn.request({"op": "prepare", "job_id": "job", "step": 1, "world_size": 1, "tenant": "", "keep": None,
                      "bytes": 600_000})
        assert directory.spares.bytes == 0 and receiver.held_bytes() == 600_000
    finally:
        conn.close()
        receiver.close()


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
