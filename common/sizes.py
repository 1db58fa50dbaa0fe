"""Byte sizes as users write them (``--shm-size 64G``) and as messages print them."""

from __future__ import annotations

import re
from fractions import Fraction

from .errors import ConfigError

__all__ = ["KiB", "MiB", "GiB", "TiB", "parse_size", "format_size"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64G"`` -> 68719476736. Binary units (K=1024, like ``docker run --shm-size``);
    ``K``/``KiB``/``KB`` are all accepted; a bare number is bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"not a size: {text!r} (expected e.g. 512M, 64G, 1T or a byte count)")
    number, unit = match.groups()
    # Exact (a float rounds byte counts above 2^53); a fraction of a byte is rounded down.
    value = int(Fraction(number) * _UNITS[unit.upper()])
    if value > (1 << 62):
        raise ConfigError(f"size too large: {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """Human-readable binary size for messages and logs (``1.5GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"
