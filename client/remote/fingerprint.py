"""A fingerprint of the model's parameters, written with each step's commit.

A reattach finds moments a previous trainer kept; they may be used only when the model's
parameters are those of the kept step (a rerun with the same job id that starts from fresh
weights must not train on them). The fingerprint is a 64-bit digest of up to
:data:`SAMPLES_PER_TENSOR` evenly spaced elements of every parameter's local data, bit for
bit: every optimizer step changes essentially every element, so fresh weights, weights of
another step and weights of another model all differ from the kept step's in the sample.

Cost per commit, whatever the size of the parameters: each parameter's samples are a strided
view (no kernel, no copy), the views of one device and dtype are gathered by one ``torch.cat``,
and the gathered bytes of a device go to the host in one copy (the only synchronisation). No
pass over the parameters.

The samples are elements ``0, s, 2s, ...`` with the integer stride ``s = (n - 1) // (count -
1)``: in range and exact at every size (a float32 ``linspace`` rounds its last index up to
``n`` above 2^24 elements, which made every real LLM weight raise ``index out of range``).

Call order: ``fp = ParamFingerprint(params)`` once, ``fp.compute()`` after each step's update
(on the stream that updated the parameters) and before its commit; compare the value of a
new trainer's parameters with the kept segment's before its first step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from swap_state.client.optim.dtensor_utils import unwrap_dtensor

__all__ = ["SAMPLES_PER_TENSOR", "UNKNOWN", "ParamFingerprint", "sample_indices", "sample_stride"]

SAMPLES_PER_TENSOR = 64
UNKNOWN = 0
"""The header value for "parameters not known" (after a load or restore): never matches."""


def sample_stride(numel: int, count: int = SAMPLES_PER_TENSOR) -> tuple[int, int]:
    """``(samples, stride)`` of a tensor of ``numel`` elements: ``min(numel, count)`` samples
    ``stride`` elements apart from element 0, all in range (Python ints: no bound on ``numel``)."""
    count = min(numel, count)
    if count <= 1:
        return count, 1
    return count, (numel - 1) // (count - 1)


def sample_indices(numel: int, count: int = SAMPLES_PER_TENSOR) -> list[int]:
    """The indices :func:`sample_stride` describes."""
    samples, stride = sample_stride(numel, count)
    return [i * stride for i in range(samples)]


def _samples(local: torch.Tensor) -> torch.Tensor | None:
    """A strided view of ``local``'s samples (a copy only when ``local`` is not contiguous)."""
    flat = local.detach().reshape(-1)
    count, stride = sample_stride(flat.numel())
    if count == 0:
        return None
    return flat.as_strided((count,), (stride,), flat.storage_offset())


class ParamFingerprint:
    """Fingerprint of a fixed list of parameters (their order is part of it).

    The sample views are made once and kept while each parameter's local data stays where it
    is (its data pointer, dtype and size, checked at every compute), so a compute costs one
    cat per device and dtype, one copy per device and a few attribute reads per parameter."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._keys: list[tuple[int, torch.dtype, int, torch.device] | None] = [None] * len(self._params)
        self._views: list[torch.Tensor | None] = [None] * len(self._params)

    def _current_views(self) -> list[torch.Tensor | None]:
        for index, param in enumerate(self._params):
            local = unwrap_dtensor(param)
            key = (local.data_ptr(), local.dtype, local.numel(), local.device)
            if key != self._keys[index]:
                self._keys[index], self._views[index] = key, _samples(local)
        return self._views

    def compute(self) -> int:
        """The digest (never :data:`UNKNOWN`) of the parameters as they are now."""
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for view in self._current_views():
            if view is not None:
                by_device.setdefault(view.device, {}).setdefault(view.dtype, []).append(view)
        digest = hashlib.blake2b(digest_size=8)
        # Devices and dtypes in a fixed order; within each, the parameters' order. Raw bytes:
        # bit-exact whatever the dtype, bfloat16 included.
        for device in sorted(by_device, key=str):
            groups = by_device[device]
            gathered = [torch.cat(groups[dtype]).view(torch.uint8) for dtype in sorted(groups, key=str)]
            host = torch.cat(gathered).cpu()  # the one copy to the host (and wait) per device
            digest.update(host.numpy().tobytes())
        value = int.from_bytes(digest.digest(), "little")
        return value or 1
