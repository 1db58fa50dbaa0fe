"""Where the Adam moments live between steps: the seam the swap container is composed over.

A :class:`MomentStore` hands out the host tensors of the moments and hears, in this order::

    allocate(entries, optimizers)   # at construction, in update order; again in a load, for
                                    # parameters without a cache (nothing live changes before)
    before_step()                   # per optimizer step, before its work is collected
    before_write(params)            # before the host bytes of ``params`` change (may block)
    after_step()                    # once per container step, every offload of it complete
    after_load()                    # once ``load_state_dict`` has written the host caches

Two implementations: :class:`PinnedHostMemory` (the trainer's own pinned memory, the in-process
container's) and ``swap_state.client.remote.segment_store.SegmentStore`` (the server's segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch.optim import Optimizer

from swap_state.client.device import DeviceBackend
from swap_state.client.optim.host_cache import STEP_DTYPE, STEP_KEY, HostCacheEntry, flat_host_caches

__all__ = ["MomentStore", "PinnedHostMemory"]

#: ``{param: {key: tensor}}``: contiguous CPU tensors of ``entry.keys`` and a 0-dim ``STEP_KEY``.
AllocatedCaches = dict[torch.Tensor, dict[str, torch.Tensor]]


class MomentStore(Protocol):
    """Host memory of the moments and the events of the swap step (call order: the module's)."""

    def allocate(self, entries: Sequence[HostCacheEntry], optimizers: Sequence[Optimizer]) -> AllocatedCaches:
        """The caches of ``entries`` (``optimizers``: the container's, whose groups they are in)."""

    def before_step(self) -> None:
        """An optimizer step begins (its group steps are about to advance)."""

    def before_write(self, params: Sequence[torch.Tensor]) -> None:
        """The host caches of ``params`` are about to be overwritten."""

    def after_step(self) -> None:
        """A container step ended: every host write of it is complete."""

    def after_load(self) -> None:
        """A load replaced the state."""


class PinnedHostMemory(MomentStore):
    """The moments in the trainer's pinned host memory (on a CPU-only process, plain memory); the
    step and load events are :class:`MomentStore`'s, which do nothing."""

    def __init__(self, backend: DeviceBackend):
        self._backend = backend

    def allocate(self, entries: Sequence[HostCacheEntry], optimizers: Sequence[Optimizer]) -> AllocatedCaches:
        """Views of one exactly sized pinned buffer; on the CPU, one tensor per moment."""
        backend = self._backend
        if backend.pin_memory_available:
            return flat_host_caches(entries, backend.alloc_host_bytes)
        cache: AllocatedCaches = {}
        # The steps as one vector: a slice's steps are then incremented as one tensor.
        steps = backend.alloc_host((len(entries),), STEP_DTYPE)
        for index, entry in enumerate(entries):
            cache[entry.param] = {key: backend.alloc_host(entry.shape, entry.dtype) for key in entry.keys}
            cache[entry.param][STEP_KEY] = steps[index]
        return cache
