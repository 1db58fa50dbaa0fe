"""The trainer side of copy-before-write, the checksum helpers and the bandwidth cap."""

from __future__ import annotations

import os
import threading
import time
import zlib

import pytest

from swap_state.common.segment import Word
from swap_state.common.checksum import crc32_combine, format_crc, parse_crc
from swap_state.common.copy_before_write import BackPressureTimeout, TrainerProtector
from swap_state.server.snapshot.writing.bandwidth import BandwidthLimiter


def _publish(segment, epoch: int, persisted_upto: int = 0) -> None:
    segment.header[Word.PERSISTED_UPTO] = persisted_upto
    segment.header[Word.SNAP_EPOCH] = epoch


def test_no_snapshot_no_copy(make_segment):
    seg = make_segment()
    protector = TrainerProtector(seg.mm, seg.layout, header=seg.header)
    assert not protector.protect(seg.chunks[0])
    assert seg.header[Word.COW_COPIES] == 0
    protector.close()


def test_copy_before_write_publishes_slot_in_order(make_segment):
    seg = make_segment(cow_slots=2)
    seg.fill(1)
    _publish(seg, epoch=3, persisted_upto=1)
    protector = TrainerProtector(seg.mm, seg.layout, header=seg.header)
    chunk = seg.chunks[5]
    before = bytes(seg.mm[chunk.offset : chunk.offset + chunk.nbytes])

    assert not protector.protect(seg.chunks[0])  # already persisted
    assert protector.protect(chunk)
    slot = seg.header.cow_slot(chunk.index) - 1
    start = seg.layout.cow_slots_offset + slot * seg.layout.chunk_bytes
    assert bytes(seg.mm[start : start + chunk.nbytes]) == before
    assert seg.header.cow_epoch(chunk.index) == 3
    assert seg.header.slot_taken(slot) == seg.header.slot_freed(slot) + 1
    assert seg.header[Word.COW_COPIES] == 1
    # The chunk now holds its step-N bytes in a slot: later writes in this epoch need no copy.
    assert not protector.protect(chunk)
    assert seg.header[Word.COW_COPIES] == 1
    protector.close()


def test_backpressure_waits_until_server_reads_the_chunk(make_segment):
    seg = make_segment(cow_slots=0)
    _publish(seg, epoch=1)
    protector = TrainerProtector(seg.mm, seg.layout, header=seg.header)
    read = threading.Event()

    def server_reads_chunk_zero():
        time.sleep(0.1)  # the trainer waits meanwhile; nothing below depends on how long
        read.set()
        seg.header[Word.PERSISTED_UPTO] = 1

    threading.Thread(target=server_reads_chunk_zero).start()
    assert not protector.protect(seg.chunks[0])
    assert read.is_set()  # it returned only once the server had read the chunk
    assert seg.header[Word.BP_WAITS] == 1
    assert seg.header[Word.BP_WAIT_NS] > 0
    protector.close()


def test_backpressure_timeout_is_counted(make_segment):
    seg = make_segment(cow_slots=0)
    _publish(seg, epoch=1)
    protector = TrainerProtector(seg.mm, seg.layout, header=seg.header, max_wait_s=0.05)
    with pytest.raises(BackPressureTimeout, match="chunk 0"):
        protector.protect(seg.chunks[0])
    assert seg.header[Word.BP_WAITS] == 1
    protector.close()


def test_protector_covers_exactly_the_overlapping_chunks(make_segment):
    seg = make_segment(cow_slots=8)
    _publish(seg, epoch=2)
    protector = TrainerProtector(seg.mm, seg.layout, header=seg.header)
    tensor = seg.layout.tensors[0]
    # Two bytes straddling the boundary of chunks 0 and 1.
    assert protector.before_write(tensor.offset + seg.layout.chunk_bytes - 1, 2) == 2
    assert {c for c in range(seg.layout.n_chunks) if seg.header.cow_epoch(c) == 2} == {0, 1}
    bf16_chunks = [c.index for c in seg.chunks if c.tensor_index == 2]
    assert len(bf16_chunks) == 3  # 10000 bytes in 4 KiB chunks
    assert protector.before_write_tensor(2) == 3
    assert seg.header[Word.COW_COPIES] == 5
    protector.close()


def test_crc32_combine_matches_zlib():
    for len_a, len_b in [(0, 0), (1, 0), (0, 7), (4096, 100_000), (3, 1 << 20)]:
        a, b = os.urandom(len_a), os.urandom(len_b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len_b) == zlib.crc32(a + b)
    assert parse_crc(format_crc(0xDEADBEEF)) == 0xDEADBEEF


def test_bandwidth_limiter_paces_and_cancels():
    limiter = BandwidthLimiter(1_000_000)  # 1 MB/s
    cancel = threading.Event()
    started = time.monotonic()
    for _ in range(5):
        assert limiter.acquire(50_000, cancel)
    # The first reservation is immediate, the next four wait 50 ms each.
    assert time.monotonic() - started >= 0.19
    cancel.set()
    assert not limiter.acquire(1_000_000, cancel)
