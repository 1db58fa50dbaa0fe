"""Small helpers: sizes, summaries of samples, /proc readings."""

from __future__ import annotations

import math
import os
import re
from fractions import Fraction
import statistics
from collections.abc import Sequence

__all__ = [
    "fmt_bytes",
    "fmt_ms",
    "gbps",
    "parse_size",
    "percentile",
    "proc_status",
    "summarize",
]

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """``16M`` -> 16777216 (binary suffixes K, M, G, T; plain integers too)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 16M, 1G, 65536)")
    return int(Fraction(match.group(1)) * _SUFFIX[match.group(2).upper()])  # exact, unlike a float


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def fmt_ms(seconds: float | None, digits: int = 1) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "n/a"
    ms = seconds * 1e3
    if ms < 1:
        return f"{ms:.3f} ms"
    if ms < 10:
        return f"{ms:.2f} ms"
    return f"{ms:.{digits}f} ms"


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    data = sorted(values)
    if not data:
        return float("nan")
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, median, p10, p90, min, max, mean, stdev of ``values`` (seconds stay seconds)."""
    values = list(values)
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p10": percentile(values, 10),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def median_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap confidence interval of the median of ``values`` (deterministic seed)."""
    import random

    data = list(values)
    if len(data) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(data, k=len(data))) for _ in range(resamples))
    tail = (1 - confidence) / 2 * 100
    return percentile(medians, tail), percentile(medians, 100 - tail)


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """Per-pair ratios (pairs taken close together in time, so that load on the machine
    hits both alike) summarized, with a 95% bootstrap interval of their median."""
    ratios = [a / b for a, b in zip(numerator, denominator) if b > 0]
    out = summarize(ratios)
    if ratios:
        out["ci95"] = list(median_ci(ratios))
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of a process, in bytes."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cpu_jiffies() -> dict[str, float]:
    """Machine-wide CPU seconds from /proc/stat: busy (user+nice+system+irq+softirq),
    iowait, steal (taken by the hypervisor), idle."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    fields += [0] * (8 - len(fields))
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return {
        "busy": (user + nice + system + irq + softirq) / hz,
        "iowait": iowait / hz,
        "steal": steal / hz,
        "idle": idle / hz,
    }


def own_cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (the embedded server)."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def loadavg() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except (OSError, ValueError):
        return []


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server told to listen on it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
