"""CRC-32 (zlib/IEEE) helpers for snapshot files.

Per tensor the writer runs ``zlib.crc32`` over the bytes as they stream by (a few GB/s, so
the checksum does not slow the disk). The checksum of a whole file is then *combined* from
the header's CRC and the tensors' CRCs with :func:`crc32_combine`, instead of a second pass
over the data. ``crc32_combine`` is zlib's algorithm (GF(2) polynomial arithmetic), which
the ``zlib`` module does not expose; it costs O(log n) 32-bit steps, independent of n.
"""

from __future__ import annotations

import zlib

__all__ = ["crc32", "crc32_combine", "format_crc", "parse_crc"]

_POLY = 0xEDB88320  # the reflected CRC-32 polynomial


def crc32(data, value: int = 0) -> int:
    """``zlib.crc32``: ``value`` continues a running checksum."""
    return zlib.crc32(data, value)


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


def _x2n_table() -> tuple[int, ...]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(1, 32):
        p = _multmodp(p, p)
        table.append(p)
    return tuple(table)


_X2N = _x2n_table()  # x^(2^n) modulo the polynomial, n = 0..31


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    if len2 < 0:
        raise ValueError("len2 must be >= 0")
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ (crc2 & 0xFFFFFFFF)


def format_crc(value: int) -> str:
    """The form stored in manifests: 8 lower-case hex digits."""
    return f"{value & 0xFFFFFFFF:08x}"


def parse_crc(text: object) -> int:
    """Inverse of :func:`format_crc`; ValueError for anything else."""
    if not isinstance(text, str) or len(text) != 8:
        raise ValueError(f"not a crc32: {text!r}")
    return int(text, 16)
