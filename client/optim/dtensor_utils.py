"""DTensor helpers of the swap optimizer: local shards in, DTensors laid out like a parameter out."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["DTensor", "check_shard_is_a_box", "global_layout", "unwrap_dtensor", "wrap_like_param",
           "wrap_like_param_without_device_move"]


def unwrap_dtensor(tensor: Any) -> Any:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def wrap_like_param(local_tensor: torch.Tensor, like: Any) -> Any:
    """``local_tensor`` as a DTensor laid out like ``like`` (unchanged if ``like`` is not one)."""
    if isinstance(like, DTensor):
        layout = {"device_mesh": like.device_mesh, "placements": like.placements, "run_check": False}
        return DTensor.from_local(local_tensor, shape=like.size(), stride=like.stride(), **layout)
    return local_tensor


def wrap_like_param_without_device_move(local_tensor: torch.Tensor, like: Any) -> Any:
    """Like :func:`wrap_like_param`, but sharing ``local_tensor``: built from a spec, so that a
    host-cache tensor stays on the host even on an accelerator mesh."""
    if not isinstance(like, DTensor):
        return local_tensor
    meta = TensorMeta(shape=like.size(), stride=like.stride(), dtype=local_tensor.dtype)
    return DTensor(local_tensor, DTensorSpec(like.device_mesh, like.placements, tensor_meta=meta), requires_grad=False)


def global_layout(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(global shape, offset of the local shard)`` of a DTensor (None for a plain tensor); a
    snapshot stores every shard as one box (:func:`check_shard_is_a_box`)."""
    if not isinstance(param, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    offset = tuple(int(o) for o in offset)
    check_shard_is_a_box(param, tuple(int(n) for n in local), offset)
    return tuple(param.shape), offset


def check_shard_is_a_box(param: DTensor, local_shape: tuple[int, ...], offset: tuple[int, ...]) -> None:
    """ValueError unless each dimension of ``param``'s local shard holds the global indices
    ``[offset, offset + local size)`` in order (a ``_StridedShard`` may not)."""
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:  # this rank holds no shard of it
        return
    placements = param.placements
    for dim in range(param.ndim):
        splits = [(m, p) for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
        if not any(isinstance(p, _StridedShard) for _, p in splits):
            continue
        indices = torch.arange(param.shape[dim]).reshape((1,) * dim + (-1,))
        for mesh_dim, placement in splits:
            pieces, _ = placement._split_tensor(indices, param.device_mesh.size(mesh_dim), with_padding=False)
            indices = pieces[coordinate[mesh_dim]]
        held = indices.reshape(-1).tolist()
        if held != list(range(offset[dim], offset[dim] + local_shape[dim])):
            raise ValueError(
                f"a DTensor of shape {tuple(param.shape)} with placements {placements} holds, on this rank, "
                f"the indices {_ranges(held)} of dimension {dim}: not one contiguous range at offset "
                f"{offset[dim]}. swap-state snapshots store each shard as one box of its global tensor; "
                "use a layout whose shards are boxes (e.g. evenly divisible sizes) or swap_state_checkpoint = 'full'")


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 6]`` as ``0-2, 5-6``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] + 1 == i:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs) or "none"
