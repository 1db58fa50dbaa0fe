"""Files anyone can read: safetensors (numpy and torch), manifests, snapshot.json."""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from snapshot_kit import SPECS, metadata_for, verify_rank_file

from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.common.snapshot_errors import SnapshotInvalid
from swap_state.common.snapshot_format import (
    DATA_ALIGN, INDEX_NAME, RankManifest, rank_data_name, rank_manifest_name, safetensors_header,
    safetensors_metadata,
)

_NUMPY = {"float32": np.float32, "uint8": np.uint8}


def _durable(make_segment, make_coordinator, metadata_json: str, seed: int = 1):
    seg = make_segment()
    contents = seg.fill(seed)
    coordinator = make_coordinator()
    status = coordinator.start(seg.source("job", 42, metadata_json=metadata_json)).wait(20)
    assert status.state is SnapshotState.DURABLE, status.error
    return seg, contents, coordinator, coordinator.local.resolve("job/step-42")


def test_rank_file_loads_with_safetensors_numpy_and_torch(make_segment, make_coordinator):
    _, contents, _, info = _durable(make_segment, make_coordinator, "")
    path = info.path / rank_data_name(0)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_len) % DATA_ALIGN == 0  # data block aligned: the server writes it with O_DIRECT
    assert raw[8 : 8 + header_len].rstrip(b" ") == raw[8 : 8 + header_len].rstrip()  # padded with spaces
    header = json.loads(raw[8 : 8 + header_len])
    assert header["__metadata__"]["swap_state.step"] == "42"

    loaded_pt = safetensors.torch.load_file(str(path))
    assert set(loaded_pt) == {name for name, _, _ in SPECS}
    for name, dtype, shape in SPECS:
        tensor = loaded_pt[name]
        assert tuple(tensor.shape) == shape
        assert str(tensor.dtype) == f"torch.{dtype}"
        assert tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == contents[name]
    # numpy has no bfloat16: load the other tensors with the numpy reader.
    with safetensors.safe_open(str(path), framework="np") as f:
        for name, dtype, shape in SPECS:
            if dtype in _NUMPY:
                array = f.get_tensor(name)
                assert array.dtype == _NUMPY[dtype] and array.shape == shape
                assert array.tobytes() == contents[name]


def test_manifest_records_layout_metadata_and_checksums(make_segment, make_coordinator):
    seg_probe = make_segment("probe")
    metadata = metadata_for(
        seg_probe, step=42, global_shapes={"layers.0.w.exp_avg": ([64, 256], [32, 0])}
    )
    _, contents, coordinator, info = _durable(make_segment, make_coordinator, metadata)
    manifest_raw = (info.path / rank_manifest_name(0)).read_bytes()
    manifest = json.loads(manifest_raw)
    assert (manifest["job_id"], manifest["step"], manifest["rank"], manifest["world_size"]) == ("job", 42, 0, 1)
    assert "metadata_json" not in manifest and manifest["version"] == 2  # compact: its own fields say it
    assert json.loads(RankManifest.from_json(manifest).metadata_json) == json.loads(metadata)  # all of it
    assert manifest["param_groups"]["layers.0.w"]["betas"] == [0.9, 0.95]
    assert manifest["steps"] == {"layers.0.w": 42, "layers.0.b": 42, "emb": 42, "empty": 42}
    by_name = {t["name"]: t for t in manifest["tensors"]}
    w = by_name["layers.0.w.exp_avg"]
    assert (w["fqn"], w["key"], w["dtype"], w["shape"]) == ("layers.0.w", "exp_avg", "float32", [32, 256])
    assert (w["global_shape"], w["global_offset"]) == ([64, 256], [32, 0])
    assert "global_shape" not in by_name["layers.0.b.exp_avg"]
    for name, data in contents.items():
        assert by_name[name]["crc32"] == f"{zlib.crc32(data):08x}"
        assert by_name[name]["nbytes"] == len(data)
    index = json.loads((info.path / INDEX_NAME).read_bytes())
    files = {f["name"]: f for f in index["files"]}
    assert files[rank_manifest_name(0)]["crc32"] == f"{zlib.crc32(manifest_raw):08x}"
    data_raw = (info.path / rank_data_name(0)).read_bytes()
    assert files[rank_data_name(0)]["crc32"] == f"{zlib.crc32(data_raw):08x}"
    assert files[rank_data_name(0)]["bytes"] == len(data_raw)
    assert (index["job_id"], index["step"], index["world_size"], index["ranks"]) == ("job", 42, 1, [0])
    # The store's own verification agrees.
    verify_rank_file(coordinator.local, info)



def test_a_version_1_manifest_is_still_read_with_its_metadata_verbatim(make_segment, make_coordinator):
    """Snapshots taken before manifests were compact (version 1: the trainer's text beside the
    same facts) restore after an upgrade: their text is returned as it was."""
    metadata = metadata_for(make_segment("probe"), step=42)
    _, _, _, info = _durable(make_segment, make_coordinator, metadata)
    compact = json.loads((info.path / rank_manifest_name(0)).read_bytes())
    old = {k: v for k, v in compact.items() if k != "metadata_extra"} | {"version": 1, "metadata_json": metadata}
    read = RankManifest.from_json(old)
    assert read.metadata_json == metadata and read.tensors == RankManifest.from_json(compact).tensors
    with pytest.raises(ValueError, match="version 1 or 2"):
        RankManifest.from_json({**compact, "version": 3})

@pytest.mark.parametrize(
    "metadata, message",
    [
        ("[1, 2]", "must be a JSON object"),
        ("{", "not valid JSON"),
        ('{"param_groups": {"w": {"lr": NaN}}}', "not valid JSON"),
        ('{"steps": {"w": 1e999}}', "not valid JSON"),
        ('{"steps": {"w": 1%s}}' % ("0" * 400), "must be finite"),
        ('{"tensors": {"nope": {"fqn": "x"}}}', "not a segment tensor"),
        ('{"tensors": {"emb.exp_avg": {"global_shape": [1, 2]}}}', "has 2 dims"),
        ('{"tensors": {"emb.exp_avg": {"global_offset": [0]}}}', "needs global_shape"),
        ('{"steps": {"w": "five"}}', "number or a tensor"),
        ('{"param_groups": {"w": {"step": {"__tensor__": 1, "dtype": "complex"}}}}', "dtype must be"),
    ],
)
def test_bad_metadata_is_refused_before_anything_happens(make_segment, make_coordinator, metadata, message):
    seg = make_segment()
    coordinator = make_coordinator()
    with pytest.raises(SnapshotInvalid, match=message):
        coordinator.start(seg.source("job", 1, metadata_json=metadata))
    assert coordinator.local.list() == []
    assert not coordinator.local.job_dir("job").exists()


def test_files_written_before_with_an_8_byte_aligned_header_still_verify(make_segment, make_coordinator):
    """Snapshots of earlier versions pad the header to 8 bytes only: their manifests say so
    (``data_start``), and restore recomputes that header, not the block-aligned one."""
    seg, contents, coordinator, info = _durable(make_segment, make_coordinator, "")
    manifest = coordinator.local.read_manifest(info, 0)
    assert manifest.data_start % DATA_ALIGN == 0
    old_header, _ = safetensors_header(
        [(t.name, t.dtype, t.shape, t.nbytes) for t in manifest.tensors],
        safetensors_metadata("job", 42, 0, 1), align=8)
    assert len(old_header) != manifest.data_start
    rewritten = dataclasses.replace(manifest, data_start=len(old_header),
                                    data_file_bytes=len(old_header) + manifest.data_file_bytes - manifest.data_start)
    assert rewritten.header_bytes() == old_header
