"""CRC-32 (zlib/IEEE) of snapshot files: per tensor as the bytes stream by, the whole file's
*combined* from those (:func:`crc32_combine`), not a second pass. From ISA-L (faster, and it
releases the GIL on large buffers); without its wheel, ``zlib.crc32`` and zlib's
``crc32_combine`` written out below (the ``zlib`` module does not expose it): the same values.
"""

from __future__ import annotations

__all__ = ["IMPLEMENTATION", "crc32", "crc32_combine", "format_crc", "parse_crc"]

_POLY = 0xEDB88320  # the reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (both reflected)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^n) modulo the polynomial, n = 0..31 (x^1 first)
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


# crc32(data, value=0): CRC-32 of any bytes-like ``data``; ``value`` continues a running one.
try:
    from isal.isal_zlib import crc32, crc32_combine as _crc32_combine
    IMPLEMENTATION = "isal"
except ImportError:  # no isal wheel for this platform: the standard library (slower)
    from zlib import crc32
    IMPLEMENTATION = "zlib"

    def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
        return _multmodp(_x2nmodp(len2, 3), crc1) ^ (crc2 & 0xFFFFFFFF)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    if len2 < 0:
        raise ValueError("len2 must be >= 0")
    return _crc32_combine(crc1, crc2, len2)


def format_crc(value: int) -> str:
    """The form stored in manifests: 8 lower-case hex digits."""
    return f"{value & 0xFFFFFFFF:08x}"


def parse_crc(text: object) -> int:
    """Inverse of :func:`format_crc`; ValueError for anything else."""
    if not isinstance(text, str) or len(text) != 8:
        raise ValueError(f"not a crc32: {text!r}")
    return int(text, 16)


class BlockChecksum:
    """The crc32 of each ``block_bytes`` block of one tensor's bytes (the last may be shorter),
    fed in order, and the whole tensor's, combined from them (one pass over the bytes). Blocks
    let a reader verify a byte range without reading the whole tensor (a reshard's restore)."""

    __slots__ = ("block_bytes", "blocks", "_value", "_fill")

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.blocks: list[int] = []
        self._value = self._fill = 0

    def update(self, data: memoryview) -> None:
        at, n, block = 0, data.nbytes, self.block_bytes
        if self._fill:  # the open block first
            at = min(n, block - self._fill)
            self._value, self._fill = crc32(data[:at], self._value), self._fill + at
            if self._fill == block:
                self.blocks.append(self._value)
                self._value = self._fill = 0
        whole = at + (n - at) // block * block  # then whole blocks, a call each (the slices freed at once)
        self.blocks += [crc32(data[i : i + block]) for i in range(at, whole, block)]
        if whole < n:
            self._value, self._fill = crc32(data[whole:]), n - whole

    def mark(self) -> tuple[int, int, int]:
        """Where the checksum stands, for :meth:`rewind` (bytes fed again from another source)."""
        return len(self.blocks), self._value, self._fill

    def rewind(self, mark: tuple[int, int, int]) -> None:
        del self.blocks[mark[0]:]
        _, self._value, self._fill = mark

    def finish(self) -> tuple[int, list[int]]:
        """(the crc32 of every byte fed, each block's crc32)."""
        blocks = self.blocks + ([self._value] if self._fill else [])
        whole = 0
        for index, value in enumerate(blocks):
            whole = crc32_combine(whole, value, self._fill if index == len(self.blocks) else self.block_bytes)
        return whole, blocks
