"""A fingerprint of the model's parameters, written with each step's commit.

A reattach finds moments a previous trainer kept; they may be used only when the model's
parameters are those of the kept step (a rerun with the same job id that starts from fresh
weights must not train on them). The fingerprint is a 64-bit digest of up to
:data:`SAMPLES_PER_TENSOR` evenly spaced elements of every parameter's local data, bit for
bit: every optimizer step changes essentially every element, so fresh weights, weights of
another step and weights of another model all differ from the kept step's in the sample,
while the cost per step is one small gather per parameter and one small copy to the host
(cheap on the device, unlike a pass over all the parameters).

Call order: ``fp = ParamFingerprint(params)`` once, ``fp.compute()`` after each step's update
(on the stream that updated the parameters) and before its commit; compare the value of a
new trainer's parameters with the kept segment's before its first step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from swap_state.client.dtensor_utils import unwrap_dtensor

__all__ = ["SAMPLES_PER_TENSOR", "UNKNOWN", "ParamFingerprint"]

SAMPLES_PER_TENSOR = 64
UNKNOWN = 0
"""The header value for "parameters not known" (after a load or restore): never matches."""


class ParamFingerprint:
    """Fingerprint of a fixed list of parameters (their order is part of it)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._indices: list[torch.Tensor | None] = [None] * len(self._params)

    def _sample(self, index: int, local: torch.Tensor) -> torch.Tensor:
        flat = local.detach().reshape(-1)
        picks = self._indices[index]
        if picks is None or picks.device != flat.device:
            count = min(flat.numel(), SAMPLES_PER_TENSOR)
            picks = torch.linspace(0, max(flat.numel() - 1, 0), count, device=flat.device).long()
            self._indices[index] = picks
        # Raw bytes: bit-exact whatever the dtype (bfloat16 included), no arithmetic.
        return flat.index_select(0, picks).contiguous().view(torch.uint8)

    def compute(self) -> int:
        """The digest (never :data:`UNKNOWN`) of the parameters as they are now."""
        samples = [self._sample(i, unwrap_dtensor(p)) for i, p in enumerate(self._params)]
        data = bytes(torch.cat(samples).cpu().tolist()) if samples else b""
        digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        return digest or 1
