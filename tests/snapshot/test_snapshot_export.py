"""export: the seed's flat state dict, loadable with plain torch.load and with DCP."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from snapshot_kit import flip_byte

from swap_state.client.cli import main as cli_main
from swap_state.client.export.snapshot import export_snapshot
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.common.snapshot_format import rank_data_name

# Per rank: a row shard of w (global 8x8) and a replicated plain bias moment.
SPECS = [
    ("w.exp_avg", "float32", (4, 8)),
    ("w.exp_avg_sq", "float32", (4, 8)),
    ("b.exp_avg", "bfloat16", (8,)),
]


def main(argv: list[str]) -> int:
    """``swap-state export`` with these arguments."""
    return cli_main(["export", *argv])


def _fill(seg, values: dict[str, torch.Tensor]) -> None:
    for tensor in seg.layout.tensors:
        raw = values[tensor.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        seg.mm[tensor.offset : tensor.offset + tensor.nbytes] = raw


def _metadata(rank: int) -> str:
    shard = {"global_shape": [8, 8], "global_offset": [4 * rank, 0]}
    return json.dumps(
        {
            "tensors": {
                "w.exp_avg": {"fqn": "model.w", "key": "exp_avg", **shard},
                "w.exp_avg_sq": {"fqn": "model.w", "key": "exp_avg_sq", **shard},
                "b.exp_avg": {"fqn": "model.b", "key": "exp_avg"},
            },
            "param_groups": {
                fqn: {"lr": 0.001, "betas": [0.9, 0.95], "amsgrad": False, "foreach": None,
                      "step": {"__tensor__": 3.0, "dtype": "float32"}}
                for fqn in ("model.w", "model.b")
            },
            "steps": {"model.w": 3, "model.b": {"__tensor__": 3.0, "dtype": "float32"}},
        }
    )


@pytest.fixture
def sharded_snapshot(make_segment, make_coordinator):
    """A two-rank snapshot; returns (snapshot dir, snapshot root, the expected flat state)."""
    torch.manual_seed(0)
    exp_avg, exp_avg_sq = torch.randn(8, 8), torch.rand(8, 8)
    bias = torch.randn(8).to(torch.bfloat16)
    coordinator = make_coordinator()
    handles = []
    for rank in range(2):
        seg = make_segment(f"r{rank}", specs=SPECS)
        rows = slice(4 * rank, 4 * rank + 4)
        _fill(seg, {"w.exp_avg": exp_avg[rows], "w.exp_avg_sq": exp_avg_sq[rows], "b.exp_avg": bias})
        handles.append(
            coordinator.start(seg.source("job", 3, rank=rank, world_size=2, metadata_json=_metadata(rank)))
        )
    assert all(h.wait(20).state is SnapshotState.DURABLE for h in handles)
    expected = {
        "state.model.w.exp_avg": exp_avg,
        "state.model.w.exp_avg_sq": exp_avg_sq,
        "state.model.b.exp_avg": bias,
        "state.model.w.step": torch.tensor(3.0),
        "state.model.b.step": torch.tensor(3.0),
    }
    for fqn in ("model.w", "model.b"):
        expected.update(
            {
                f"param_groups.{fqn}.lr": 0.001,
                f"param_groups.{fqn}.betas": (0.9, 0.95),
                f"param_groups.{fqn}.amsgrad": False,
                f"param_groups.{fqn}.foreach": None,
                f"param_groups.{fqn}.step": torch.tensor(3.0),
            }
        )
    return coordinator.local.resolve("job/step-3").path, coordinator.local.root, expected


def _assert_same(loaded: dict, expected: dict) -> None:
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype, key
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value and type(loaded[key]) is type(value), key


def test_export_torch_loads_with_plain_torch(sharded_snapshot, tmp_path):
    path, _, expected = sharded_snapshot
    result = export_snapshot(path, tmp_path / "out.pt", format="torch")
    assert (result.snapshot_id, result.tensors, result.entries) == ("job/step-3", 3, len(expected))
    _assert_same(torch.load(tmp_path / "out.pt", weights_only=True), expected)


def test_export_dcp_loads_into_a_template(sharded_snapshot, tmp_path):
    _, root, expected = sharded_snapshot
    export_snapshot("job/latest", tmp_path / "dcp", format="dcp", snapshot_dir=root)
    template = {
        key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else "placeholder"
        for key, value in expected.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    _assert_same(template, expected)


def test_export_cli_reports_success_and_corruption(sharded_snapshot, tmp_path, capsys):
    path, _, _ = sharded_snapshot
    assert main([str(path), str(tmp_path / "a.pt")]) == 0
    assert "exported job/step-3" in capsys.readouterr().out
    flip_byte(path / rank_data_name(1), (path / rank_data_name(1)).stat().st_size - 3)
    assert main([str(path), str(tmp_path / "b.pt"), "--format", "dcp"]) == 1
    err = capsys.readouterr().err
    assert rank_data_name(1) in err and "'b.exp_avg'" in err
    assert not (tmp_path / "b.pt").exists()


def test_a_snapshot_is_named_in_either_spelling(sharded_snapshot, tmp_path):
    """The directory is ``step-000000000003``; ``step-3`` (as printed) names it too: as a path,
    as an id under --snapshot-dir, and ``latest`` beside it."""
    path, root, expected = sharded_snapshot
    assert path.name == "step-000000000003"
    short_path = path.parent / "step-3"
    assert not short_path.exists()
    for n, (snapshot, snapshot_dir) in enumerate(
        [
            (short_path, None),
            (str(path.parent / "step-03"), None),
            (path.parent / "latest", None),
            ("job/step-3", root),
            ("job/step-000000000003", root),
        ]
    ):
        result = export_snapshot(snapshot, tmp_path / f"{n}.pt", snapshot_dir=snapshot_dir)
        assert result.snapshot_id == "job/step-3", snapshot
        _assert_same(torch.load(tmp_path / f"{n}.pt", weights_only=True), expected)


def test_export_cli_takes_the_short_spelling_of_a_directory_and_prints_the_short_id(
    sharded_snapshot, tmp_path, capsys
):
    path, root, _ = sharded_snapshot
    assert main([str(path.parent / "step-3"), str(tmp_path / "a.pt")]) == 0
    assert "exported job/step-3 (" in capsys.readouterr().out
    assert main(["job/step-000000000003", str(tmp_path / "b.pt"), "--snapshot-dir", str(root)]) == 0
    assert "exported job/step-3 (" in capsys.readouterr().out


def test_export_of_a_step_that_is_not_there_or_an_id_without_its_directory_says_which(
    sharded_snapshot, tmp_path, capsys, monkeypatch
):
    path, root, _ = sharded_snapshot
    assert main([str(path.parent / "step-4"), str(tmp_path / "a.pt")]) == 1
    err = capsys.readouterr().err
    assert "no complete snapshot job/step-4" in err and str(root) in err
    monkeypatch.chdir(tmp_path)  # the id is not a path from here
    assert main(["job/step-3", str(tmp_path / "b.pt")]) == 1
    err = capsys.readouterr().err
    assert "is not a snapshot directory" in err and "needs --snapshot-dir" in err
    assert "/snapshots/demo/step-25 or /snapshots/demo/step-000000000025" in err
