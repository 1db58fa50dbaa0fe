"""``swap-state export`` reads torchtitan's DCP checkpoints without executing them: a planted
``.metadata`` or a planted non-tensor entry is refused, naming what it asked for, and runs
nothing; a real checkpoint loads as DCP saved it."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from swap_state.client.export.snapshot import ExportError
from swap_state.client.export.torchtitan import read_checkpoint


class _Planted:
    """An object whose unpickling makes a directory: what a planted checkpoint would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_a_real_checkpoint_loads_as_saved(tmp_path):
    weight = torch.randn(3, 4)
    _save({"model": {"w": weight}, "dataloader": {"rank_0": b"\x80state"}, "lr": {"last": [1, 2.5, "s"]}}, tmp_path)
    state = read_checkpoint(tmp_path)
    assert torch.equal(state["model"]["w"], weight)
    assert state["lr"] == {"last": [1, 2.5, "s"]} and state["dataloader"] == {"rank_0": b"\x80state"}


def test_a_planted_metadata_is_refused_and_runs_nothing(tmp_path):
    _save({"model": {"w": torch.ones(2)}}, tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(ExportError, match=r"asks to load posix\.mkdir.*refused"):
        read_checkpoint(tmp_path)
    assert not marker.exists()


def test_a_planted_entry_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    _save({"model": {"w": torch.ones(2)}, "evil": _Planted(str(marker))}, tmp_path / "ckpt")
    assert not marker.exists()  # saving it ran nothing either
    with pytest.raises(ExportError, match="entry 'evil' of the checkpoint is not plain data"):
        read_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()
