"""A shard is stored as one box of its global tensor: ``_StridedShard`` layouts are checked
(FSDP over a tensor-parallel dimension), a strided shard that is no box is refused."""

from __future__ import annotations

import types

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from swap_state.client.optim.dtensor_utils import check_shard_is_a_box


class _Mesh:
    def __init__(self, sizes: tuple[int, ...], coordinate: tuple[int, ...]):
        self.sizes, self.coordinate = sizes, coordinate

    def get_coordinate(self):
        return list(self.coordinate)

    def size(self, mesh_dim: int) -> int:
        return self.sizes[mesh_dim]


def _param(shape, placements, sizes, coordinate):
    return types.SimpleNamespace(shape=shape, ndim=len(shape), placements=tuple(placements),
                                 device_mesh=_Mesh(sizes, coordinate))


@pytest.mark.parametrize(("coordinate", "offset"), [((0, 0), 0), ((0, 1), 4), ((1, 0), 2), ((1, 1), 6)])
def test_fsdp_over_tensor_parallel_rows_are_boxes(coordinate, offset):
    # torch's own example (_StridedShard's docstring): 8 rows, mesh (dp 2, tp 2).
    param = _param((8, 8), [_StridedShard(0, split_factor=2), Shard(0)], (2, 2), coordinate)
    check_shard_is_a_box(param, (2, 8), (offset, 0))
    with pytest.raises(ValueError, match="not one contiguous range"):
        check_shard_is_a_box(param, (2, 8), ((offset + 2) % 8, 0))  # an offset torch did not give


def test_a_strided_shard_that_is_no_box_is_refused_naming_its_indices():
    param = _param((8, 3), [_StridedShard(0, split_factor=2)], (2,), (0,))  # rows 0-1 and 4-5
    with pytest.raises(ValueError, match=r"indices 0-1, 4-5 of dimension 0.*swap_state_checkpoint = 'full'"):
        check_shard_is_a_box(param, (4, 3), (0, 0))
