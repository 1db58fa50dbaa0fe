"""The writer's sinks on a real file: O_DIRECT through bounce buffers (pieces of any size,
replaced before they are final, the last block padded then truncated, a write the filesystem
refuses made buffered), and a chunk split into pieces overwritten by the trainer midway."""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import random
import shutil
import tempfile
import zlib

import pytest
from snapshot_kit import PAGE_BYTES, verify_rank_file

from swap_state.common.segment import Word
from swap_state.common.snapshot_format import rank_data_name
from swap_state.server.snapshot.writing import sink as snapshot_sink
from swap_state.server.snapshot.writing import writer as snapshot_writer
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.server.snapshot.writing import snapshot_file as local_storage
from swap_state.server.snapshot.writing.snapshot_file import SnapshotFile
from swap_state.server.snapshot.writing.sink import BLOCK_BYTES, BufferedSink, DirectSink, open_sink

from test_snapshot_consistency import _file_tensors
from test_snapshot_writer_zero_copy import _overwrite_as_trainer


def _pieces(rng: random.Random, total: int) -> list[bytes]:
    out, done = [], 0
    while done < total:
        n = min(total - done, rng.choice([1, 7, 512, 4095, 4096, 4097, 10_000, 70_000]))
        out.append(rng.randbytes(n))
        done += n
    return out


def _write(sink, pieces: list[bytes], replace_every: int = 0) -> int:
    crc = 0
    for index, piece in enumerate(pieces):
        view = memoryview(bytearray(piece))
        done = 0
        while done < len(piece):
            size = min(sink.room(), len(piece) - done)
            if replace_every and index % replace_every == 0:
                sink.put(memoryview(bytearray(size))).release()  # wrong bytes first ...
                placed = sink.replace(view[done : done + size])  # ... replaced before final
            else:
                placed = sink.put(view[done : done + size])
            with placed:
                crc = zlib.crc32(placed, crc)  # the bytes as placed
            sink.advance()
            done += size
    sink.finish()
    return crc


@pytest.mark.parametrize("total", [0, 1, BLOCK_BYTES, 3 * 16384 + 123, 200_001])
def test_direct_sink_writes_exactly_the_pieces(tmp_path, total):
    rng = random.Random(total)
    pieces = _pieces(rng, total)
    expected = b"".join(pieces)
    with SnapshotFile(tmp_path / "f") as file:
        fd = file.open_direct()
        assert fd is not None, "the test directory is on a filesystem without O_DIRECT"
        with DirectSink(file, fd, bounce_bytes=16384) as sink:
            crc = _write(sink, pieces, replace_every=3)
            assert sink.position == total and not sink.fell_back
    assert (tmp_path / "f").read_bytes() == expected  # no padding left after the last byte
    assert crc == zlib.crc32(expected)


def test_buffered_sink_writes_exactly_the_pieces(tmp_path):
    pieces = _pieces(random.Random(3), 100_000)
    with SnapshotFile(tmp_path / "f") as file, BufferedSink(file) as sink:
        crc = _write(sink, pieces, replace_every=2)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces) and crc == zlib.crc32(b"".join(pieces))


def test_a_direct_write_the_filesystem_refuses_is_made_buffered(tmp_path, monkeypatch, caplog):
    real = snapshot_sink.pwrite_all
    refused = []

    def pwrite_all(fd, data, offset):
        if fd == direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data, offset)

    monkeypatch.setattr(snapshot_sink, "pwrite_all", pwrite_all)
    pieces = _pieces(random.Random(4), 50_000)
    with SnapshotFile(tmp_path / "f") as file:
        direct_fd = file.open_direct()
        with caplog.at_level(logging.WARNING), DirectSink(file, direct_fd, bounce_bytes=8192) as sink:
            _write(sink, pieces)
            assert sink.fell_back and refused
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    assert [r.msg for r in caplog.records].count("snapshot_direct_io_refused") == 1


def test_a_disk_error_in_a_write_in_flight_reaches_the_writer(tmp_path, monkeypatch):
    def pwrite_all(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot_sink, "pwrite_all", pwrite_all)
    with SnapshotFile(tmp_path / "f") as file, DirectSink(file, file.open_direct(), bounce_bytes=4096) as sink:
        with pytest.raises(OSError) as raised:
            _write(sink, _pieces(random.Random(5), 40_000))
    assert raised.value.errno == errno.ENOSPC


def test_open_sink_falls_back_where_the_filesystem_refuses_o_direct(tmp_path, monkeypatch):
    real_open = local_storage.os.open

    def open_(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs before Linux 6.6 says
        return real_open(path, flags, *args)

    monkeypatch.setattr(local_storage.os, "open", open_)
    with SnapshotFile(tmp_path / "f") as file, open_sink(file) as sink:
        assert isinstance(sink, BufferedSink) and not sink.direct
        sink.write_all(b"x" * 5000)
        sink.finish()
    assert (tmp_path / "f").read_bytes() == b"x" * 5000


def test_a_chunk_in_pieces_overwritten_midway_is_finished_from_the_trainer_slot(
    make_segment, make_coordinator, monkeypatch
):
    """Chunks of four pages, bounce buffers of one: the pieces before the overwrite came from
    the segment and stay; the piece being read and the rest come from the trainer's slot."""
    monkeypatch.setattr(snapshot_sink, "BOUNCE_BYTES", PAGE_BYTES)
    seg = make_segment(chunk_bytes=4 * PAGE_BYTES, cow_slots=2)
    at_step_n = seg.fill(seed=9)
    victim = next(c for c in seg.chunks if c.nbytes == 4 * PAGE_BYTES and c.index > 0)
    real_place = snapshot_writer._place
    seen = {"pieces": 0, "done": False}

    def place(sink, data, stable):
        assert sink.direct
        if not seen["done"] and seg.header[Word.PERSISTED_UPTO] == victim.index:
            seen["pieces"] += 1
            if seen["pieces"] == 3:  # two pieces of the victim placed: the trainer overwrites it
                seen["done"] = True
                _overwrite_as_trainer(seg, victim)
        return real_place(sink, data, stable)

    monkeypatch.setattr(snapshot_writer, "_place", place)
    coordinator = make_coordinator()
    status = coordinator.start(seg.source("job", 4)).wait(20)
    assert seen["done"] and status.state is SnapshotState.DURABLE, status.error
    assert _file_tensors(status.path + "/" + rank_data_name(0)) == at_step_n
    info = coordinator.local.resolve("job/step-4")
    verify_rank_file(coordinator.local, info)
    [data_file] = [f for f in info.index.files if f.name == rank_data_name(0)]
    assert os.path.getsize(status.path + "/" + rank_data_name(0)) == data_file.bytes


@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "buffered"])
def test_each_persisted_rank_logs_how_it_was_written(make_segment, make_coordinator, monkeypatch, caplog, direct):
    if not direct:
        monkeypatch.setattr(SnapshotFile, "open_direct", lambda self: None)
    seg = make_segment()
    at_step_n = seg.fill(seed=3)
    with caplog.at_level(logging.INFO, logger="swap_state.server.snapshot.writing.writer"):
        status = make_coordinator().start(seg.source("job", 2)).wait(20)
    assert status.state is SnapshotState.DURABLE and _file_tensors(status.path + "/" + rank_data_name(0)) == at_step_n
    [fields] = [r.swap_state_fields for r in caplog.records if r.msg == "snapshot_rank_persisted"]
    assert fields["direct_io"] is direct and fields["bytes"] == status.bytes_total and fields["rank"] == 0


def test_a_file_in_memory_is_written_without_a_bounce_buffer(tmp_path):
    """tmpfs takes O_DIRECT since Linux 6.6, but a bounce buffer there is a copy for nothing."""
    folder = tempfile.mkdtemp(prefix="swap-state-sink-", dir="/dev/shm")
    try:
        with open_sink(SnapshotFile(pathlib.Path(folder) / "f")) as sink:
            assert isinstance(sink, BufferedSink)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    with SnapshotFile(tmp_path / "f") as file:
        fd = file.open_direct()
        assert fd is not None, "the test directory is on a filesystem without O_DIRECT"
        os.close(fd)
    with open_sink(SnapshotFile(tmp_path / "g")) as sink:
        assert isinstance(sink, DirectSink)
