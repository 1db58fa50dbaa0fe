"""A fingerprint of the model's parameters, written with each step's commit.

A reattach finds moments a previous trainer kept; they may be used only when the model's
parameters are those of the kept step (a rerun with the same job id that starts from fresh
weights must not train on them). The fingerprint is a 64-bit digest of up to
:data:`SAMPLES_PER_TENSOR` evenly spaced elements of every parameter's local data, bit for
bit: every optimizer step changes essentially every element, so fresh weights, weights of
another step and weights of another model all differ from the kept step's in the sample.

Cost per commit, whatever the size of the parameters: each parameter's samples are a strided
view (no kernel, no copy), made once and kept while its data stays put (one list of data
pointers compared per commit); the views of one device and dtype are gathered by one
``torch.cat``, and the gathered bytes of a device go to the host in one copy (the only
synchronisation). No pass over the parameters' data, no call per parameter.

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

from swap_state.client.optim.dtensor_utils import DTensor, unwrap_dtensor

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

    The sample views are made once and grouped once by device and dtype; they are kept while
    no parameter's local data has moved. The check per compute is one list of data pointers
    compared with the last one (a C-speed pass, no call per parameter of this module); when
    any pointer differs, each parameter's full key (pointer, dtype, size, device) is checked
    and the views of the ones that changed are made again. Why the pointers suffice between
    those checks: a kept view holds its storage alive, so no other allocation can take its
    address; data at an unchanged address with another dtype or size would be a view of the
    same memory (no training code does that), and it would only make the digest differ from a
    fresh trainer's, so a reattach drops the kept state rather than trusting it.

    A compute is then one ``torch.cat`` per device and dtype (the gather), one more per
    device when it holds several dtypes, one copy to the host per device (the only wait)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._dtensors = [i for i, p in enumerate(self._params) if isinstance(p, DTensor)]
        self._keys: list[tuple[int, torch.dtype, int, torch.device] | None] = [None] * len(self._params)
        self._views: list[torch.Tensor | None] = [None] * len(self._params)
        self._pointers: list[int] | None = None
        self._groups: list[list[list[torch.Tensor]]] = []

    def _locals(self) -> list[torch.Tensor]:
        """The parameters' local data now (a DTensor's local shard may be swapped by FSDP)."""
        if not self._dtensors:
            return self._params
        locals_ = list(self._params)
        for index in self._dtensors:
            locals_[index] = unwrap_dtensor(locals_[index])
        return locals_

    def _current_groups(self) -> list[list[list[torch.Tensor]]]:
        """Per device (by name), per dtype (by name): the sample views, in parameter order."""
        locals_ = self._locals()
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
        # Devices and dtypes in a fixed order; within each, the parameters' order. Raw bytes:
        # bit-exact whatever the dtype, bfloat16 included.
        for dtypes in self._current_groups():
            gathered = [torch.cat(views).view(torch.uint8) for views in dtypes]
            joined = gathered[0] if len(gathered) == 1 else torch.cat(gathered)
            host = joined.cpu()  # the one copy to the host (and wait) per device
            digest.update(host.numpy().tobytes())
        value = int.from_bytes(digest.digest(), "little")
        return value or 1
