"""Copies from host memory the runtime does not treat as pinned (Ascend).

Older torch_npu synchronizes after each non-blocking copy from memory it did not allocate (and
CANN's docs warn about unlocked memory on kernels <= 5.10).
Each Ascend registration is probed (:func:`needs_bounce`); where its copies are not
asynchronous, copies from it go through a :class:`BounceRing` of pinned buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BOUNCE_SLOTS", "BOUNCE_SLOT_BYTES", "PROBE_MARGIN_S", "PROBE_SLOWDOWN", "BounceRing",
    "CopyProbe", "ProbeConfig", "copies_are_async", "needs_bounce",
    "npu_versions", "probe_registered_copies",
]

logger = logging.getLogger(__name__)

#: The bounce ring: slots x bytes of pinned memory (the host stages a few pieces ahead).
BOUNCE_SLOTS = 4
BOUNCE_SLOT_BYTES = 8 << 20


def npu_versions() -> str:
    """``"CANN <v>, torch_npu <v>"`` as far as they can be read (for the fallback's warning)."""
    torch_npu = sys.modules.get("torch_npu")
    cann = ""
    # No such call before CANN 8.1: the toolkit's install file has the version then.
    with contextlib.suppress(Exception):
        cann = str(torch_npu.utils.get_cann_version(module="CANN"))  # type: ignore[union-attr]
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH") or ""
    for info in sorted(glob.glob(os.path.join(home, "*", "ascend_toolkit_install.info"))) if home else ():
        if cann:
            break
        with contextlib.suppress(OSError), open(info, encoding="utf-8") as lines:
            cann = next((line.split("=", 1)[1].strip() for line in lines if line.startswith("version=")), "")
    return f"CANN {cann or 'unknown'}, torch_npu {getattr(torch_npu, '__version__', 'unknown')}"


@dataclass(frozen=True)
class ProbeConfig:
    """The probe's bytes, and device work enqueued first so that an async copy is still pending."""

    nbytes: int = 4 << 20
    busy_side: int = 2048
    busy_matmuls: int = 8


@dataclass(frozen=True)
class CopyProbe:
    """A copy from the registered range and one from pinned memory: pending on return, and time."""

    registered_pending: bool
    registered_seconds: float
    pinned_pending: bool
    pinned_seconds: float


#: A registered copy call this many times slower than the pinned one (and by more than
#: PROBE_MARGIN_S) waited for its copy: the runtime synchronized after it.
PROBE_SLOWDOWN = 4.0
PROBE_MARGIN_S = 1e-3


def copies_are_async(probe: CopyProbe) -> bool:
    """Whether copies from the registered range are asynchronous: pending, yes; not pending
    while the pinned one was, no; neither pending: by the call times."""
    if probe.registered_pending:
        return True
    if probe.pinned_pending:
        return False
    limit = max(PROBE_SLOWDOWN * probe.pinned_seconds, probe.pinned_seconds + PROBE_MARGIN_S)
    return probe.registered_seconds <= limit


def probe_registered_copies(
    backend: Any, ptr: int, nbytes: int, config: ProbeConfig = ProbeConfig()
) -> CopyProbe:
    """Time a non-blocking H2D copy from ``[ptr, ptr + nbytes)`` (only read) against one from
    pinned memory, each on a side stream behind ``config``'s device work."""
    size = min(config.nbytes, nbytes)
    device = backend.current_device()
    registered = torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)
    sources = (backend.alloc_host((size,), torch.uint8), registered)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    busy = torch.zeros((2, config.busy_side, config.busy_side), device=device)
    stream = backend.stream()
    measured: list[tuple[bool, float]] = []
    for source in (sources[0], *sources):  # the first, unmeasured: the runtime's lazy setup
        with backend.use_stream(stream):
            for _ in range(config.busy_matmuls):
                torch.mm(busy[0], busy[0], out=busy[1])
            started = time.perf_counter()
            target.copy_(source, non_blocking=True)
            seconds = time.perf_counter() - started
            done = backend.event()
            done.record(stream)
            measured.append((not done.query(), seconds))
        stream.synchronize()
    (pinned_pending, pinned_s), (registered_pending, registered_s) = measured[1:]
    return CopyProbe(registered_pending, registered_s, pinned_pending, pinned_s)


_WARNED_SYNCHRONOUS = False


def needs_bounce(backend: Any, ptr: int, nbytes: int) -> bool:
    """Whether copies from a new registration must bounce (after the process's one WARNING).
    A probe that fails says False: a check must not fail what it checks."""
    global _WARNED_SYNCHRONOUS
    try:
        probe = probe_registered_copies(backend, ptr, nbytes, backend.copy_probe)
    except Exception as exc:
        logger.warning("could not probe copies from registered host memory (%s); copying directly", exc)
        return False
    if copies_are_async(probe):
        return False
    if not _WARNED_SYNCHRONOUS:  # the process's one WARNING
        _WARNED_SYNCHRONOUS = True
        versions = npu_versions() if backend.type == "npu" else f"{backend.type}, torch {torch.__version__}"
        logger.warning(
            "%s: a non-blocking copy from memory registered with aclrtHostRegister is not "
            "asynchronous (the host waited %.2f ms, %.2f ms from pinned memory); copies from "
            "registered host memory go through a small ring of pinned bounce buffers from now on "
            "(slower than direct DMA; a torch_npu / CANN that honours aclrtHostRegister avoids it)",
            versions, probe.registered_seconds * 1e3, probe.pinned_seconds * 1e3,
        )  # fmt: skip
    return True


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("a bounced copy needs contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


class BounceRing:
    """Pinned staging slots, used round robin, for copies between unpinned host memory and the
    device. ``to_device`` returns once every piece is enqueued; ``to_host`` once ``dst`` holds
    every byte (the host writes it, so an event on ``stream`` could not vouch for it)."""

    def __init__(self, slots: Sequence[torch.Tensor], new_event: Callable[[], Any]) -> None:
        if not slots:
            raise ValueError("a bounce ring needs at least one slot")
        self._slots = [_flat_bytes(slot) for slot in slots]
        self._events: list[Any] = [None] * len(slots)
        self._new_event = new_event
        self._next = 0
        self._lock = threading.RLock()
        self.pieces = 0  # pieces staged so far, both ways

    def _take(self) -> int:
        """The next slot, once its last copy has completed."""
        index, self._next = self._next, (self._next + 1) % len(self._slots)
        self._wait(index)
        self.pieces += 1
        return index

    def _wait(self, index: int) -> None:
        event, self._events[index] = self._events[index], None
        if event is not None:
            event.synchronize()

    def _mark(self, index: int, stream: Any) -> None:
        event = self._new_event()
        event.record(stream)
        self._events[index] = event

    def _pieces(self, nbytes: int) -> list[tuple[int, int]]:
        size = min(len(slot) for slot in self._slots)
        return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)]

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        source, target = _flat_bytes(src), _flat_bytes(dst)
        with self._lock:
            for start, size in self._pieces(source.numel()):
                index = self._take()
                slot = self._slots[index][:size]
                slot.copy_(source[start : start + size])
                target[start : start + size].copy_(slot, non_blocking=True)
                self._mark(index, stream)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        source, target = _flat_bytes(src), _flat_bytes(dst)
        in_flight: list[tuple[int, int, int]] = []

        def land(index: int, start: int, size: int) -> None:
            self._wait(index)
            target[start : start + size].copy_(self._slots[index][:size])

        with self._lock:
            for start, size in self._pieces(source.numel()):
                if len(in_flight) == len(self._slots):
                    land(*in_flight.pop(0))
                index = self._take()
                self._slots[index][:size].copy_(source[start : start + size], non_blocking=True)
                self._mark(index, stream)
                in_flight.append((index, start, size))
            for piece in in_flight:
                land(*piece)

