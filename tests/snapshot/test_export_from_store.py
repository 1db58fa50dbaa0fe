"""``swap-state export --snapshot-store``: a snapshot read from the snapshot store (a shared
directory, or a real S3 endpoint) exports bitwise equal to what the ranks held, with the local
snapshot directory gone; a corrupt or missing object names the object (and the tensor) and writes nothing;
an unreachable store fails at once, in one line naming the URI and the flag.

The snapshots are taken by the server's coordinator with a store, which uploads each durable
snapshot (per-rank markers last); the tests wait until every rank is ``stored``."""

from __future__ import annotations

import asyncio

import json
import shutil
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from snapshot_kit import SPECS, flip_byte_of_tensor, metadata_for, swap_state_cli
from swap_state.client.cli import main as cli_main
from swap_state.client.export.torchtitan import read_checkpoint
from swap_state.client.optim.checkpoint_template import (
    MODEL_REF_KEY,
    OPTIMIZER_KEY,
    SNAPSHOT_REF_KEY,
)
from swap_state.common.names import step_dir_name
from swap_state.common.snapshot_format import rank_data_name
from swap_state.common.trainer_header import TrainerHeader
from swap_state.server.snapshot.coordinator import SnapshotState

JOB, STEP, WORLD = "job", 3, 2
SNAPSHOT = f"{JOB}/step-{STEP}"
STEP_DIR = f"{JOB}/{step_dir_name(STEP)}"


def main(argv: list[str]) -> int:
    """``swap-state export`` with these arguments."""
    return cli_main(["export", *argv])


def _row_shards(specs) -> dict[str, tuple[list[int], list[int]]]:
    """Every tensor split by rows over the ranks: name -> rank's (global shape, offset)."""
    return {name: ([WORLD * shape[0], *shape[1:]], [0] * len(shape)) for name, _, shape in specs}


def _sharded_metadata(segment, rank: int) -> str:
    shards = {
        name: (shape, [rank * (shape[0] // WORLD), *offset[1:]])
        for name, (shape, offset) in _row_shards(segment.specs).items()
    }
    return metadata_for(segment, step=STEP, global_shapes=shards)


def _whole_state_metadata(segment, rank: int) -> str:
    shard = {"global_shape": [8, 8], "global_offset": [4 * rank, 0]}
    return json.dumps({
        "tensors": {"model.w": {"fqn": "w", "key": "param", **shard},
                    "w.exp_avg": {"fqn": "w", "key": "exp_avg", **shard}},
        "param_groups": {"w": {"lr": 0.001}},
        "steps": {"w": STEP},
    })  # fmt: skip


@pytest.fixture
def stored_snapshot(make_segment, make_coordinator, tmp_path):
    """``stored(store_uri, specs, metadata)``: a two-rank snapshot taken by a coordinator with
    that store, uploaded, then its local directory removed. Returns each rank's tensor bytes."""

    def stored(store_uri: str, specs=SPECS, metadata=_sharded_metadata) -> list[dict[str, bytes]]:
        coordinator = make_coordinator(store_uri=store_uri)
        handles, contents = [], []
        for rank in range(WORLD):
            segment = make_segment(f"r{rank}", specs=specs)
            contents.append(segment.fill(seed=rank + 1))
            TrainerHeader(segment.header).publish_model(STEP)  # whole state: the model's copy is in
            source = segment.source(JOB, STEP, rank=rank, world_size=WORLD, metadata_json=metadata(segment, rank))
            handles.append(coordinator.start(source))
        for rank, handle in enumerate(handles):
            assert handle.wait(20).state is SnapshotState.DURABLE
            assert asyncio.run(coordinator.wait_status(SNAPSHOT, rank, wait_s=30, wait_stored=True)).state.value == "stored"
        shutil.rmtree(coordinator.local.root / JOB)  # the store holds the only copy now
        return contents

    return stored


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_exported(state: dict, contents: list[dict[str, bytes]]) -> None:
    """Each tensor is the ranks' row shards one after the other, bit for bit."""
    for name, dtype, shape in SPECS:
        fqn, _, key = name.rpartition(".")
        tensor = state[f"state.{fqn}.{key}"]
        assert str(tensor.dtype) == f"torch.{dtype}" and list(tensor.shape) == [WORLD * shape[0], *shape[1:]], name
        assert _raw(tensor) == b"".join(c[name] for c in contents), name
    assert torch.equal(state["state.layers.0.w.step"], torch.tensor(float(STEP)))
    assert state["param_groups.layers.0.w.betas"] == (0.9, 0.95)


def _no_leftovers(out) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(".*from-store*")), "the downloaded snapshot was not removed"


def test_export_from_a_shared_directory_store_is_bitwise(stored_snapshot, tmp_path):
    store = tmp_path / "store"
    contents = stored_snapshot(str(store))
    assert not (tmp_path / "snapshots" / JOB).exists()
    out = tmp_path / "out" / "state.pt"
    done = swap_state_cli("export", "job/latest", str(out), "--snapshot-store", str(store))
    assert done.returncode == 0, done.stderr
    assert "exported job/step-3" in done.stdout and "ranks" not in done.stdout
    _assert_exported(torch.load(out, weights_only=True), contents)
    assert sorted(p.name for p in out.parent.iterdir()) == ["state.pt"]  # no download left


def test_export_dcp_from_a_file_uri_and_a_snapshot_uri(stored_snapshot, tmp_path, capsys):
    store = f"file://{tmp_path / 'store'}"
    contents = stored_snapshot(store)
    out = tmp_path / "dcp"
    # The snapshot as the store names it (swap-state snapshots lists those URIs).
    assert main([f"{store}/{STEP_DIR}", str(out), "--format", "dcp", "--snapshot-store", store]) == 0
    assert "exported job/step-3" in capsys.readouterr().out
    template = {}
    for name, dtype, shape in SPECS:
        fqn, _, key = name.rpartition(".")
        template[f"state.{fqn}.{key}"] = torch.empty([WORLD * shape[0], *shape[1:]], dtype=getattr(torch, dtype))
    template["state.layers.0.w.step"] = torch.zeros(())
    template["param_groups.layers.0.w.betas"] = "placeholder"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(template, checkpoint_id=str(out), no_dist=True)
    _assert_exported(template, contents)
    assert sorted(p.name for p in tmp_path.glob(".*")) == []


@pytest.mark.parametrize("damage", ["flip a tensor byte", "remove the data object"])
def test_a_corrupt_object_names_object_and_tensor_and_writes_nothing(stored_snapshot, tmp_path, capsys, damage):
    store = tmp_path / "store"
    stored_snapshot(str(store))
    data = store / STEP_DIR / rank_data_name(1)
    if damage == "flip a tensor byte":
        flip_byte_of_tensor(data, "layers.0.b.exp_avg", at=17)
    else:
        data.unlink()
    out = tmp_path / "out" / "state.pt"
    assert main([SNAPSHOT, str(out), "--snapshot-store", str(store)]) == 1
    err = capsys.readouterr().err
    assert f"{store}/{STEP_DIR}/{rank_data_name(1)}" in err, err
    if damage == "flip a tensor byte":
        assert "tensor 'layers.0.b.exp_avg' fails its checksum" in err, err
    else:
        assert f"{rank_data_name(1)} is missing" in err, err
    _no_leftovers(out)


def test_an_s3_endpoint_nobody_listens_on_fails_fast_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "dummy")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "dummy")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    out = tmp_path / "out.pt"
    started = time.monotonic()
    done = swap_state_cli("export", SNAPSHOT, str(out), "--snapshot-store", "s3://nobucket/x", timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("swap-state export: --snapshot-store s3://nobucket/x: "), err
    assert "AWS_ENDPOINT_URL" in err
    _no_leftovers(out)


def test_store_flag_errors(tmp_path, capsys):
    out = tmp_path / "out.pt"
    missing = tmp_path / "no-such-store"
    assert main([SNAPSHOT, str(out), "--snapshot-store", str(missing)]) == 1
    assert f"--snapshot-store {missing}: {missing} is not a directory" in capsys.readouterr().err
    assert main([SNAPSHOT, str(out), "--snapshot-store", "ftp://host/x"]) == 1
    assert "--snapshot-store 'ftp://host/x': expected s3://" in capsys.readouterr().err
    assert main([SNAPSHOT, str(out), "--snapshot-store", str(tmp_path), "--snapshot-dir", str(tmp_path)]) == 1
    assert "give one of --snapshot-dir and --snapshot-store, not both" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "titan"), "--format", "torchtitan"]) == 1
    assert "--format torchtitan needs --snapshot-dir DIR" in capsys.readouterr().err
    assert main([SNAPSHOT, str(out), "--snapshot-store", str(tmp_path)]) == 1  # an empty store
    assert "no complete snapshot job/step-3 of job 'job' in the store" in capsys.readouterr().err
    _no_leftovers(out)


def test_export_from_a_real_s3_endpoint(stored_snapshot, s3_store, tmp_path, capsys):
    contents = stored_snapshot(s3_store)
    out = tmp_path / "state.pt"
    assert main([SNAPSHOT, str(out), "--snapshot-store", s3_store]) == 0, capsys.readouterr().err
    _assert_exported(torch.load(out, weights_only=True), contents)
    assert [p.name for p in tmp_path.iterdir() if "from-store" in p.name] == []


def test_torchtitan_checkpoint_exports_with_the_snapshot_from_the_store(stored_snapshot, tmp_path, capsys):
    store = tmp_path / "store"
    specs = [("model.w", "float32", (4, 8)), ("w.exp_avg", "float32", (4, 8))]
    contents = stored_snapshot(str(store), specs, _whole_state_metadata)
    checkpoint = tmp_path / "checkpoint" / "step-3"
    small = {MODEL_REF_KEY: SNAPSHOT, OPTIMIZER_KEY: {SNAPSHOT_REF_KEY: SNAPSHOT}, "train_state": {"step": STEP}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(small, checkpoint_id=str(checkpoint), no_dist=True)
    out = tmp_path / "plain" / "step-3"
    assert main(["--format", "torchtitan", str(checkpoint), str(out), "--snapshot-store", str(store)]) == 0
    assert "ranks [0, 1]" in capsys.readouterr().out
    plain = read_checkpoint(out)
    assert _raw(plain["w"]) == contents[0]["model.w"] + contents[1]["model.w"]
    assert _raw(plain[OPTIMIZER_KEY]["state.w.exp_avg"]) == contents[0]["w.exp_avg"] + contents[1]["w.exp_avg"]
    assert plain["train_state"] == {"step": STEP}
    assert [p.name for p in out.parent.iterdir()] == ["step-3"]
