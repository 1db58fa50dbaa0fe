"""DTensor helpers of the swap optimizer: local shards in, DTensors laid out like a parameter out.

The optimizer updates local shards only; checkpoints and ``optimizer.state`` carry DTensors
laid out like their parameter. These are the defaults of the names the seed's tests patch on
:mod:`swap_state.client.swap_optimizer`; the job modules call them through
:mod:`swap_state.client.optim.patch_points`, so such a patch takes effect.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "DTensor",
    "global_layout",
    "unwrap_dtensor",
    "wrap_like_param",
    "wrap_like_param_without_device_move",
]


def unwrap_dtensor(tensor: Any) -> Any:
    """The local tensor of a DTensor; anything else unchanged."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def wrap_like_param(local_tensor: torch.Tensor, like: Any) -> Any:
    """``local_tensor`` as a DTensor laid out like ``like`` (unchanged if ``like`` is not one)."""
    if isinstance(like, DTensor):
        return DTensor.from_local(
            local_tensor,
            device_mesh=like.device_mesh,
            placements=like.placements,
            shape=like.size(),
            stride=like.stride(),
            run_check=False,
        )
    return local_tensor


def wrap_like_param_without_device_move(local_tensor: torch.Tensor, like: Any) -> Any:
    """Like :func:`wrap_like_param`, but never copies: the DTensor shares ``local_tensor``.

    Built from a spec rather than ``DTensor.from_local`` so that a host-cache tensor stays
    on the host even when the mesh is an accelerator mesh.
    """
    if not isinstance(like, DTensor):
        return local_tensor
    spec = DTensorSpec(
        like.device_mesh,
        like.placements,
        tensor_meta=TensorMeta(shape=like.size(), stride=like.stride(), dtype=local_tensor.dtype),
    )
    return DTensor(local_tensor, spec, requires_grad=False)


def global_layout(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(global shape, offset of the local shard)`` of a DTensor; None for a plain tensor."""
    if not isinstance(param, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(param.shape), tuple(int(o) for o in offset)
