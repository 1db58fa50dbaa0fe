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
