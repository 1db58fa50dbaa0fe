"""A reshard reads only the byte ranges its new shards need, rounded out to the source tensors'
checksum blocks, each block checked: from a local file (O_DIRECT, page aligned) and from a tier
without one (exact ranges); a corrupt block it reads is refused, one it does not read is not its
business; a manifest written before blocks is read whole, as before (issue 51, item 3)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import tempfile

import pytest
from snapshot_kit import flip_byte, metadata_for

from swap_state.common.snapshot_errors import SnapshotCorruptError
from swap_state.common.snapshot_format import (
    RankManifest, TensorRecord, checksum_block_bytes, rank_data_name, rank_manifest_name)
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.server.snapshot.restoring import restore_reads
from swap_state.server.snapshot.restoring.restore import restore
from swap_state.server.snapshot.restoring.restore_reads import TensorRead

ROWS, COLS, OLD, NEW = 1024, 1024, 4, 3  # a 4 MiB moment, FSDP on 4 ranks resumed on 3
ROW = COLS * 4


def _rows(world: int, rank: int) -> tuple[int, int]:
    """FSDP's Shard(0) rows of ``rank`` (torch.chunk: ceil-sized, the last ones short)."""
    size = math.ceil(ROWS / world)
    return min(rank * size, ROWS), min((rank + 1) * size, ROWS)


def _shard_spec(world: int, rank: int):
    lo, hi = _rows(world, rank)
    return [("w.exp_avg", "float32", (hi - lo, COLS))]


@pytest.fixture
def fsdp4(make_segment, make_coordinator):
    """job/step-3 of one 1024 x 1024 moment FSDP-sharded on 4 ranks: (tier, the global bytes)."""
    coordinator, whole = make_coordinator(), b""
    handles = []
    for rank in range(OLD):
        seg = make_segment(f"old{rank}", specs=_shard_spec(OLD, rank))
        whole += seg.fill(20 + rank)["w.exp_avg"]
        metadata = metadata_for(seg, step=3, global_shapes={"w.exp_avg": ([ROWS, COLS], [_rows(OLD, rank)[0], 0])})
        handles.append(coordinator.start(seg.source("job", 3, rank=rank, world_size=OLD, metadata_json=metadata)))
    assert all(h.wait(30).state is SnapshotState.DURABLE for h in handles)
    return coordinator.local, whole


class _Remote(SnapshotReader):
    """The same files as a tier with no file on this host (a store, a peer): read by byte range."""

    def local_file(self, info, name):
        return None


def _resume(tier, make_segment, rank: int) -> tuple[dict, object]:
    seg = make_segment(f"new{rank}", specs=_shard_spec(NEW, rank))
    seg.fill(99)
    placement = metadata_for(seg, step=3, global_shapes={"w.exp_avg": ([ROWS, COLS], [_rows(NEW, rank)[0], 0])})
    result = restore(tier, "job/step-3", seg.mm, seg.layout, header=seg.header, job_id="job", rank=rank,
                     world_size=NEW, placement_json=placement)
    return seg.tensors(), result


@pytest.mark.parametrize("remote", [False, True], ids=["local-o-direct", "by-range"])
def test_a_reshard_reads_only_the_blocks_its_new_shard_needs(fsdp4, make_segment, monkeypatch, remote):
    local, whole = fsdp4
    tier = _Remote(local.root) if remote else local
    reads: list[tuple[int, int]] = []
    real_local, real_remote = restore_reads._LocalFile.read, restore_reads._TierFile.read

    def spy(real):
        def read(self, buffer, address, position):
            reads.append((position, buffer.nbytes))
            return real(self, buffer, address, position)
        return read

    monkeypatch.setattr(restore_reads._LocalFile, "read", spy(real_local))
    monkeypatch.setattr(restore_reads._TierFile, "read", spy(real_remote))
    for rank in range(NEW):
        reads.clear()
        tensors, result = _resume(tier, make_segment, rank)
        lo, hi = _rows(NEW, rank)
        assert tensors["w.exp_avg"] == whole[lo * ROW:hi * ROW]
        needed, read = (hi - lo) * ROW, sum(n for _, n in reads)
        sources = len(result.source_ranks)
        # Whole blocks of 16 KiB (4 rows) at most one more per end of each source's range; a
        # local file's spans are page aligned too (the header ends on a page).
        assert needed <= read <= needed + 2 * sources * checksum_block_bytes(256 * ROW), (rank, read, needed)
        assert read < sum(_rows(OLD, r)[1] - _rows(OLD, r)[0] for r in result.source_ranks) * ROW  # not whole


def test_a_corrupt_block_is_refused_only_when_it_is_read(fsdp4, make_segment):
    """New rank 0 needs old rank 1's first 86 rows: a flipped byte in its last row is never read
    (the restore succeeds, bitwise); one in its first row fails the restore, naming the block."""
    local, whole = fsdp4
    info = local.resolve("job/step-3")
    path = info.path / rank_data_name(1)
    manifest = local.read_manifest(info, 1)
    start = manifest.data_start + manifest.tensors[0].data_offsets[0]
    flip_byte(path, start + 255 * ROW + 5)  # old rank 1's last row
    tensors, _ = _resume(local, make_segment, 0)
    assert tensors["w.exp_avg"] == whole[:342 * ROW]
    flip_byte(path, start + 3)  # its first row: in a block new rank 0 reads
    with pytest.raises(SnapshotCorruptError, match=r"rank-00001.safetensors: tensor 'w.exp_avg' fails its checksum \(block 0:"):
        _resume(local, make_segment, 0)


def test_a_tensor_without_blocks_is_read_and_checked_whole(fsdp4, make_segment, monkeypatch):
    """A manifest written before blocks (no block_bytes): its tensors are read whole, as before."""
    local, whole = fsdp4
    info = local.resolve("job/step-3")
    record = local.read_manifest(info, 1).tensors[0]
    assert record.block_bytes == checksum_block_bytes(record.nbytes) == 16384 and len(record.block_crcs) == 4 * 64
    old = dataclasses.replace(record, block_bytes=0, block_crcs=b"")
    assert TensorRead.covering(old, [(5, 9)]).ranges == ((0, record.nbytes),)
    assert TensorRead.covering(record, [(5, 9), (16384, 16390), (70000, 70001)]).ranges == ((0, 32768), (65536, 81920))
    assert "block_bytes" not in old.to_json() and TensorRecord.from_json(old.to_json()) == old
    assert TensorRecord.from_json(record.to_json()) == record


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "block_crcs": t["block_crcs"][:-8]}, "one crc32 per 16384-byte block"),
    (lambda t: {**t, "block_crcs": "not base64!"}, "not base64"),
    (lambda t: {**t, "block_bytes": 0}, "block_bytes of w.exp_avg must be an integer >= 1"),
    (lambda t: {**t, "block_bytes": 1}, "block_bytes of w.exp_avg must be a multiple of 4096"),
])
def test_a_manifest_whose_blocks_do_not_tile_its_tensor_is_refused(fsdp4, change, message):
    local, _ = fsdp4
    info = local.resolve("job/step-3")
    raw = json.loads((info.path / rank_manifest_name(0)).read_bytes())
    raw["tensors"][0] = change(raw["tensors"][0])
    with pytest.raises(ValueError, match=message):
        RankManifest.from_json(raw)


@pytest.fixture
def in_memory_dir():
    """A snapshot directory on tmpfs, as a server's memory-only snapshots and replicas are."""
    if not pathlib.Path("/dev/shm").is_dir():
        pytest.skip("needs /dev/shm (tmpfs)")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="swap-state-test-") as path:
        yield pathlib.Path(path)


def test_a_snapshot_in_memory_is_read_where_it_lies_and_still_checked(in_memory_dir, make_segment,
                                                                       make_coordinator, monkeypatch):
    """A file on tmpfs is mapped, not read into buffers (no pread); its blocks are checked all the same."""
    seg = make_segment("mem", specs=_shard_spec(1, 0))
    contents = seg.fill(5)
    local = make_coordinator(snapshot_dir=in_memory_dir)
    assert local.start(seg.source("job", 3, metadata_json=metadata_for(seg, step=3))).wait(30).state is SnapshotState.DURABLE
    reads = []
    real_preadv = restore_reads.os.preadv
    monkeypatch.setattr(restore_reads.os, "preadv", lambda *args: reads.append(args[2]) or real_preadv(*args))
    target = make_segment("back", specs=_shard_spec(1, 0))

    def restore_back():
        return restore(local.local, "job/step-3", target.mm, target.layout, header=target.header, job_id="job",
                       rank=0, world_size=1)

    restore_back()
    assert target.tensors() == contents and reads == []
    info = local.local.resolve("job/step-3")
    manifest = local.local.read_manifest(info, 0)
    flip_byte(info.path / rank_data_name(0), manifest.data_start + 3 * ROW)
    with pytest.raises(SnapshotCorruptError, match=r"tensor 'w.exp_avg' fails its checksum \(block 0:"):
        restore_back()


def test_a_delivery_that_fails_ends_the_reads_of_every_span(fsdp4, monkeypatch):
    """The caller's copy failing midway (its error raised as it is) stops the reader thread,
    however many spans were left to read: nothing hangs."""
    local, _ = fsdp4
    monkeypatch.setattr(restore_reads, "BLOCK_BYTES", 4096)
    info = local.resolve("job/step-3")
    manifest = local.read_manifest(info, 0)
    tensor = manifest.tensors[0]
    reads = TensorRead.covering(tensor, [(i * 32768, i * 32768 + 4096) for i in range(16)])  # 16 spans

    def deliver(*_):
        raise OSError("the copy failed")

    with pytest.raises(OSError, match="the copy failed"):
        restore_reads.stream_tensors(local, info, {0: (manifest, [reads])}, deliver)


def test_a_tier_answering_more_bytes_than_asked_is_refused(fsdp4, make_segment, monkeypatch):
    """A store or peer whose range read returns more than it was asked is not trusted: the
    restore fails naming the file (and a restore falls back to the store's copy on that)."""
    local, _ = fsdp4
    tier = _Remote(local.root)
    real = _Remote._read_range
    monkeypatch.setattr(_Remote, "_read_range", lambda self, info, name, offset, nbytes:
                        real(self, info, name, offset, nbytes) + (b"x" if offset >= 4096 else b""))
    with pytest.raises(SnapshotCorruptError, match=r"rank-0000[01].safetensors: a read of \d+ bytes at \d+ returned"):
        _resume(tier, make_segment, 0)
