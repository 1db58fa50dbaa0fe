"""The memory rule's inputs, owned once: the persist rate (measured by the snapshot writers,
else assumed; never above ``--persist-max-bandwidth``) and the assumed forward/backward time.
One :class:`CopyBudgetPolicy` per server, shared by the arena and the snapshot coordinator.
"""

from __future__ import annotations

import threading

from swap_state.common.segment import ASSUMED_FWD_BWD_S, ASSUMED_PERSIST_BYTES_PER_S, CopyBudget, SegmentLayout

__all__ = ["CopyBudgetPolicy"]


class CopyBudgetPolicy:
    def __init__(self, *, assumed_bytes_per_s: float = ASSUMED_PERSIST_BYTES_PER_S,
                 max_bandwidth: float | None = None, fwd_bwd_s: float = ASSUMED_FWD_BWD_S):
        self.assumed_bytes_per_s = assumed_bytes_per_s  # the persist rate until a snapshot measured one
        self.max_bandwidth = max_bandwidth  # the writers' cap (``--persist-max-bandwidth``): no rate is above it
        self.fwd_bwd_s = fwd_bwd_s  # the forward/backward time assumed between a snapshot and the next optimizer step
        self._measured: float | None = None  # bytes/s, smoothed over snapshots
        self._lock = threading.Lock()

    def record(self, bytes_per_s: float | None) -> None:
        """A finished snapshot's persist rate (ignored when unknown)."""
        if bytes_per_s is None or bytes_per_s <= 0:
            return
        with self._lock:
            self._measured = bytes_per_s if self._measured is None else 0.5 * self._measured + 0.5 * bytes_per_s

    def rate(self) -> tuple[float, bool]:
        """(bytes/s, measured) the rule uses now."""
        measured = self._measured
        rate = measured if measured is not None else self.assumed_bytes_per_s
        if self.max_bandwidth is not None:
            rate = min(rate, self.max_bandwidth)
        return rate, measured is not None

    def budget(self, layout: SegmentLayout) -> CopyBudget:
        """The rule for a segment of ``layout``: do all its copy slots cover what of its tensors
        the disk cannot persist within one forward/backward?"""
        return CopyBudget(layout.tensor_bytes, layout.cow_slots * layout.chunk_bytes, *self.rate(), self.fwd_bwd_s)

    def shortfall(self, layout: SegmentLayout) -> dict[str, object] | None:
        """The fields of a ``copy_budget_short`` warning when :meth:`budget` falls short, else None."""
        budget = self.budget(layout)
        if not budget.short_bytes:
            return None
        return dict(state_bytes=budget.state_bytes, slot_bytes=budget.slot_bytes, needed_bytes=budget.needed_bytes,
                    persist_bytes_per_s=int(budget.persist_bytes_per_s), persist_measured=budget.persist_measured,
                    assumed_fwd_bwd_s=budget.fwd_bwd_s, detail=budget.warning())
