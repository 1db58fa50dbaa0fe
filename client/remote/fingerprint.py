"""A fingerprint of the model's parameters, written with each step's commit: a reattach uses
kept moments only when the parameters are those of the kept step. A 64-bit digest of up to
:data:`SAMPLES_PER_TENSOR` evenly spaced elements of every parameter's local data, bit for bit
(every step changes essentially every element); the stride is an integer, as a float32
``linspace`` rounds its last index out of range above 2^24 elements.

Call order: ``fp = ParamFingerprint(params)`` once, ``fp.compute()`` after each update (on
its stream), before the commit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from swap_state.client.optim.dtensor_utils import DTensor, unwrap_dtensor

__all__ = ["SAMPLES_PER_TENSOR", "UNKNOWN", "ParamFingerprint", "sample_stride"]

SAMPLES_PER_TENSOR = 64
UNKNOWN = 0
"""The header value for "parameters not known" (after a load or restore): never matches."""


def sample_stride(numel: int, count: int = SAMPLES_PER_TENSOR) -> tuple[int, int]:
    """``(samples, stride)`` of a tensor of ``numel`` elements: ``min(numel, count)`` samples
    ``stride`` elements apart from element 0, all in range (Python ints: no bound on ``numel``)."""
    count = min(numel, count)
    return count, ((numel - 1) // (count - 1) if count > 1 else 1)


def _samples(local: torch.Tensor) -> torch.Tensor | None:
    """A strided view of ``local``'s samples (a copy only when ``local`` is not contiguous)."""
    flat = local.detach().reshape(-1)
    count, stride = sample_stride(flat.numel())
    return flat.as_strided((count,), (stride,), flat.storage_offset()) if count else None


class ParamFingerprint:
    """Fingerprint of a fixed list of parameters (their order is part of it).

    The sample views are kept while the list of data pointers is unchanged: a kept view holds
    its storage alive, so no other allocation can take its address; when a pointer differs,
    the views of the parameters whose (pointer, dtype, size, device) changed are made again."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._dtensors = [i for i, p in enumerate(self._params) if isinstance(p, DTensor)]
        self._keys: list[tuple[int, torch.dtype, int, torch.device] | None] = [None] * len(self._params)
        self._views: list[torch.Tensor | None] = [None] * len(self._params)
        self._pointers: list[int] | None = None
        self._groups: list[list[list[torch.Tensor]]] = []

    def _current_groups(self) -> list[list[list[torch.Tensor]]]:
        """Per device, per dtype (both by name): the sample views, in parameter order."""
        locals_ = list(self._params)
        for index in self._dtensors:  # a DTensor's local shard may be swapped by FSDP
            locals_[index] = unwrap_dtensor(locals_[index])
        pointers = [local.data_ptr() for local in locals_]
        if pointers != self._pointers:
            for index, local in enumerate(locals_):
                key = (local.data_ptr(), local.dtype, local.numel(), local.device)
                if key != self._keys[index]:
                    self._keys[index], self._views[index] = key, _samples(local)
            by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
            for view in self._views:
                if view is not None:
                    by_device.setdefault(view.device, {}).setdefault(view.dtype, []).append(view)
            self._groups = [
                [dtypes[dtype] for dtype in sorted(dtypes, key=str)]
                for _, dtypes in sorted(by_device.items(), key=lambda item: str(item[0]))
            ]
            self._pointers = pointers
        return self._groups

    def compute(self) -> int:
        """The digest (never :data:`UNKNOWN`) of the parameters as they are now."""
        digest = hashlib.blake2b(digest_size=8)
        # Raw bytes: bit-exact whatever the dtype, bfloat16 included.
        for dtypes in self._current_groups():
            gathered = [torch.cat(views).view(torch.uint8) for views in dtypes]
            joined = gathered[0] if len(gathered) == 1 else torch.cat(gathered)
            host = joined.cpu()  # the one copy to the host (and wait) per device
            digest.update(host.numpy().tobytes())
        value = int.from_bytes(digest.digest(), "little")
        return value or 1
