"""CRC-32 of snapshot files: the isal implementation and the zlib fallback agree with zlib."""

from __future__ import annotations

import importlib.util
import mmap
import random
import sys
import zlib

import pytest

from swap_state.common import checksum


@pytest.fixture
def fallback(monkeypatch):
    """A separate copy of swap_state.common.checksum loaded as if isal were not installed."""
    monkeypatch.setitem(sys.modules, "isal", None)  # `import isal...` raises ImportError
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    spec = importlib.util.spec_from_file_location("_checksum_without_isal", checksum.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.IMPLEMENTATION == "zlib"
    return module


def _blocks(seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [0, 1, 3, 4095, 4096, 65537, 1 << 20, rng.randrange(1, 300_000)]
    return [rng.randbytes(n) for n in sizes]


def test_isal_is_used_where_installed():
    pytest.importorskip("isal.isal_zlib")
    assert checksum.IMPLEMENTATION == "isal"


@pytest.mark.parametrize("which", ["default", "fallback"])
def test_crc32_and_combine_match_zlib(which, request):
    impl = checksum if which == "default" else request.getfixturevalue("fallback")
    blocks = _blocks()
    running = 0
    combined = 0
    for block in blocks:
        assert impl.crc32(block) == zlib.crc32(block)
        assert impl.crc32(memoryview(block)) == zlib.crc32(block)
        running = impl.crc32(block, running)
        combined = impl.crc32_combine(combined, impl.crc32(block), len(block))
    whole = b"".join(blocks)
    assert running == combined == zlib.crc32(whole)
    # A mapped buffer, sliced like the writer slices the segment.
    with mmap.mmap(-1, len(whole)) as mapped:
        mapped[:] = whole
        with memoryview(mapped) as view, view[100:200_100] as part:
            assert impl.crc32(part, 123) == zlib.crc32(whole[100:200_100], 123)
    with pytest.raises(ValueError):
        impl.crc32_combine(1, 2, -1)


def test_both_implementations_give_identical_values(fallback):
    rng = random.Random(11)
    for _ in range(200):
        crc1, crc2 = rng.getrandbits(32), rng.getrandbits(32)
        len2 = rng.choice([0, 1, 7, 4096, rng.getrandbits(20), rng.getrandbits(40), 1 << 36])
        assert checksum.crc32_combine(crc1, crc2, len2) == fallback.crc32_combine(crc1, crc2, len2)
    for block in _blocks(3):
        seed = rng.getrandbits(32)
        assert checksum.crc32(block, seed) == fallback.crc32(block, seed)


def test_format_and_parse_are_unchanged():
    assert checksum.format_crc(0xDEADBEEF) == "deadbeef"
    assert checksum.format_crc(0x1) == "00000001"
    assert checksum.parse_crc("deadbeef") == 0xDEADBEEF
    for bad in ("", "deadbee", 12, None, "deadbeef0"):
        with pytest.raises(ValueError):
            checksum.parse_crc(bad)


@pytest.mark.parametrize("block", [4096, 16384])
def test_block_checksums_match_zlib_per_block_and_whole_fed_in_any_pieces(block):
    """The writer's one pass: pieces of any size, one of them placed again after a rewind (a
    chunk the trainer overwrote, read again from its slot)."""
    rng = random.Random(block)
    data = rng.randbytes(5 * block + 123)
    summed = checksum.BlockChecksum(block)
    view, at = memoryview(data), 0
    while at < len(data):
        size = min(rng.choice([1, 100, block - 1, block, 3 * block + 7]), len(data) - at)
        mark = summed.mark()
        summed.update(memoryview(bytes(size)))  # wrong bytes first ...
        summed.rewind(mark)
        summed.update(view[at:at + size])  # ... then the right ones
        at += size
    whole, blocks = summed.finish()
    assert whole == zlib.crc32(data)
    assert blocks == [zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)]
    assert checksum.BlockChecksum(block).finish() == (0, [])  # an empty tensor
