"""A fingerprint of the model's parameters, written with each step's commit.

A reattach finds moments a previous trainer kept; they may be used only when the model's
parameters are those of the kept step (a rerun with the same job id that starts from fresh
weights must not train on them). The fingerprint is a 64-bit digest of up to
:data:`SAMPLES_PER_TENSOR` evenly spaced elements of every parameter's local data, bit for
bit: every optimizer step changes essentially every element, so fresh weights, weights of
another step and weights of another model all differ from the kept step's in the sample.

Cost per commit, whatever the number of parameters: one small asynchronous gather kernel per
parameter, each writing into its own place of one preallocated buffer per device, then one
copy of that buffer to the host (the only synchronisation). No pass over the parameters.

The sample indices are integers, ``i * (n - 1) // (count - 1)``, computed once on the host:
exact at every size (a float32 ``linspace`` rounds its last index up to ``n`` above 2^24
elements, which made every real LLM weight raise ``index out of range``).

Call order: ``fp = ParamFingerprint(params)`` once, ``fp.compute()`` after each step's update
(on the stream that updated the parameters) and before its commit; compare the value of a
new trainer's parameters with the kept segment's before its first step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swap_state.client.optim.dtensor_utils import unwrap_dtensor

__all__ = ["SAMPLES_PER_TENSOR", "UNKNOWN", "ParamFingerprint", "sample_indices"]

SAMPLES_PER_TENSOR = 64
UNKNOWN = 0
"""The header value for "parameters not known" (after a load or restore): never matches."""

_ALIGN = 8  # every sample run starts 8-byte aligned in the buffer, so it can be viewed as any dtype


def sample_indices(numel: int, count: int = SAMPLES_PER_TENSOR) -> list[int]:
    """``min(numel, count)`` evenly spaced indices into ``range(numel)``, first and last
    included, in exact integer arithmetic (Python ints: no bound on ``numel``)."""
    count = min(numel, count)
    if count <= 1:
        return [0] * count
    return [i * (numel - 1) // (count - 1) for i in range(count)]


@dataclass
class _DevicePlan:
    """Where each parameter's samples go in one device's gather buffer."""

    buffer: torch.Tensor  # uint8, on the device
    runs: list[tuple[int, torch.Tensor, torch.Tensor, int]]  # (param, indices, out view, byte offset)


class ParamFingerprint:
    """Fingerprint of a fixed list of parameters (their order is part of it)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._plans: dict[torch.device, _DevicePlan] | None = None
        self._key: tuple | None = None

    def _layout_key(self, locals_: list[torch.Tensor]) -> tuple:
        return tuple((t.device, t.dtype, t.numel()) for t in locals_)

    def _plan(self, locals_: list[torch.Tensor]) -> dict[torch.device, _DevicePlan]:
        """One buffer per device and each parameter's indices and place in it (built once;
        again only if a parameter moves or changes dtype or size)."""
        sizes: dict[torch.device, int] = {}
        places: list[tuple[int, torch.device, int, list[int]]] = []
        for index, local in enumerate(locals_):
            picks = sample_indices(local.numel())
            if not picks:
                continue
            offset = sizes.get(local.device, 0)
            places.append((index, local.device, offset, picks))
            sizes[local.device] = offset + -(-len(picks) * local.element_size() // _ALIGN) * _ALIGN
        plans = {
            device: _DevicePlan(torch.empty(size, dtype=torch.uint8, device=device), [])
            for device, size in sizes.items()
        }
        for index, device, offset, picks in places:
            dtype = locals_[index].dtype
            nbytes = len(picks) * locals_[index].element_size()
            out = plans[device].buffer[offset : offset + nbytes].view(dtype)
            indices = torch.tensor(picks, dtype=torch.int64, device=device)
            plans[device].runs.append((index, indices, out, offset))
        return plans

    def compute(self) -> int:
        """The digest (never :data:`UNKNOWN`) of the parameters as they are now."""
        locals_ = [unwrap_dtensor(p).detach().reshape(-1) for p in self._params]
        key = self._layout_key(locals_)
        if self._plans is None or key != self._key:
            self._plans, self._key = self._plan(locals_), key
        digest = hashlib.blake2b(digest_size=8)
        # Devices in a fixed order; padding bytes are never written, so each run is hashed
        # by itself (raw bytes: bit-exact whatever the dtype, bfloat16 included).
        for device in sorted(self._plans, key=str):
            plan = self._plans[device]
            for index, indices, out, _ in plan.runs:
                torch.index_select(locals_[index], 0, indices, out=out)
            host = plan.buffer.cpu()  # the one copy to the host (and wait) per device
            for _, _, out, start in plan.runs:
                digest.update(host[start : start + out.numel() * out.element_size()].numpy())
        value = int.from_bytes(digest.digest(), "little")
        return value or 1
