"""Restore: verified first, then copied; every refusal names the file and leaves the segment."""

from __future__ import annotations

import json

import pytest
from snapshot_kit import SPECS, flip_byte, metadata_for

from swap_state.common.segment import Word
from swap_state.server.snapshot.restoring.restore import restore
from swap_state.server.snapshot.coordinator import SnapshotState
from swap_state.common.snapshot_errors import (
    SnapshotBusyError,
    SnapshotCorruptError,
    SnapshotLayoutMismatch,
    SnapshotNotFoundError,
)
from swap_state.common.snapshot_format import INDEX_NAME, LAYOUT_NAME, rank_data_name, rank_manifest_name


@pytest.fixture
def snapshot(make_segment, make_coordinator):
    """A durable job/step-8 of a filled segment; returns (store, info, contents, metadata)."""
    seg = make_segment("source")
    contents = seg.fill(8)
    metadata = metadata_for(seg, step=8)
    coordinator = make_coordinator()
    status = coordinator.start(seg.source("job", 8, metadata_json=metadata)).wait(20)
    assert status.state is SnapshotState.DURABLE
    return coordinator.local, coordinator.local.resolve("job/step-8"), contents, metadata


def _target(make_segment, specs=SPECS):
    seg = make_segment("target", specs=specs)
    seg.fill(1234)
    return seg, seg.tensor_area()


def _restore(store, seg, snapshot_id="job/step-8", world_size=1):
    return restore(store, snapshot_id, seg.mm, seg.layout,
                   header=seg.header, job_id="job", rank=0, world_size=world_size)


def test_restore_roundtrip_returns_step_and_metadata(snapshot, make_segment):
    store, _, contents, metadata = snapshot
    seg, _ = _target(make_segment)
    result = _restore(store, seg, "latest")
    assert (result.snapshot_id, result.step) == ("job/step-8", 8)
    assert json.loads(result.metadata_json) == json.loads(metadata)  # every fact the trainer gave
    assert result.bytes_restored == sum(len(b) for b in contents.values())
    assert seg.tensors() == contents


def _tensor_data_offset(info, name: str) -> int:
    manifest = json.loads((info.path / rank_manifest_name(0)).read_bytes())
    [entry] = [t for t in manifest["tensors"] if t["name"] == name]
    return manifest["data_start"] + entry["data_offsets"][0] + entry["nbytes"] // 2


def test_flipped_data_byte_is_refused_naming_file_and_tensor(snapshot, make_segment):
    store, info, _, _ = snapshot
    flip_byte(info.path / rank_data_name(0), _tensor_data_offset(info, "layers.0.b.exp_avg_sq"))
    seg, before = _target(make_segment)
    with pytest.raises(SnapshotCorruptError) as caught:
        _restore(store, seg)
    assert str(info.path / rank_data_name(0)) in str(caught.value)
    assert "'layers.0.b.exp_avg_sq'" in str(caught.value)
    assert seg.tensor_area() == before


@pytest.mark.parametrize(
    "file, offset, message",
    [
        (rank_data_name(0), 20, "header does not match"),
        (rank_manifest_name(0), 40, "does not match its checksum"),
    ],
)
def test_flipped_header_or_manifest_byte_is_refused(snapshot, make_segment, file, offset, message):
    store, info, _, _ = snapshot
    flip_byte(info.path / file, offset)
    seg, before = _target(make_segment)
    with pytest.raises(SnapshotCorruptError, match=message) as caught:
        _restore(store, seg)
    assert file in str(caught.value)
    assert seg.tensor_area() == before


def test_truncated_or_missing_file_is_refused(snapshot, make_segment):
    store, info, _, _ = snapshot
    path = info.path / rank_data_name(0)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)
    seg, before = _target(make_segment)
    with pytest.raises(SnapshotCorruptError, match="bytes"):
        _restore(store, seg)
    path.unlink()
    with pytest.raises(SnapshotCorruptError, match="missing"):
        _restore(store, seg)
    assert seg.tensor_area() == before


@pytest.mark.parametrize(
    "specs, message",
    [
        (SPECS[:-1], "has no tensor|is not in the segment"),
        ([(n, "float16" if n == "emb.exp_avg" else d, s) for n, d, s in SPECS], "'emb.exp_avg' is uint8"),
        ([(n, d, (16, 512) if n == "layers.0.w.exp_avg" else s) for n, d, s in SPECS], r"float32\[32, 256\]"),
        ([SPECS[1], SPECS[0], *SPECS[2:]], "update order differs"),
    ],
    ids=["missing-tensor", "dtype", "shape", "order"],
)
def test_layout_mismatch_is_refused(snapshot, make_segment, specs, message):
    store, info, _, _ = snapshot
    seg, before = _target(make_segment, specs)
    with pytest.raises(SnapshotLayoutMismatch, match=message) as caught:
        _restore(store, seg)
    assert str(info.path / rank_data_name(0)) in str(caught.value)
    assert seg.tensor_area() == before


def test_world_size_mismatch_and_unknown_ids(snapshot, make_segment):
    store, info, _, _ = snapshot
    seg, before = _target(make_segment)
    with pytest.raises(SnapshotLayoutMismatch, match="world_size 1, this job has 2") as caught:
        _restore(store, seg, world_size=2)
    assert INDEX_NAME in str(caught.value)
    with pytest.raises(SnapshotNotFoundError):
        _restore(store, seg, "job/step-9")
    with pytest.raises(SnapshotNotFoundError):
        _restore(store, seg, "other/latest")
    assert seg.tensor_area() == before


def test_restore_refused_while_the_segment_is_being_snapshotted(snapshot, make_segment):
    store, _, _, _ = snapshot
    seg, before = _target(make_segment)
    seg.header[Word.SNAP_EPOCH] = 5
    with pytest.raises(SnapshotBusyError):
        _restore(store, seg)
    assert seg.tensor_area() == before


#: FSDP's shards of an 8x8 moment on 2 ranks, and a norm's moment every rank holds whole.
SHARDED = [("w.exp_avg", "float32", (4, 8)), ("n.exp_avg", "float32", (8,))]
WHOLE = [("w.exp_avg", "float32", (8, 8)), ("n.exp_avg", "float32", (8,))]


def _fsdp_pair(make_segment, make_coordinator):
    """job/step-4 of FSDP on 2 ranks: (coordinator, each rank's shard, the replicated norm)."""
    coordinator = make_coordinator()
    olds = [make_segment(f"old{r}", specs=SHARDED) for r in range(2)]
    norm = olds[0].fill(1)["n.exp_avg"]
    handles = []
    for rank, seg in enumerate(olds):
        seg.fill(10 + rank)
        n = seg.layout.tensors[1]
        seg.mm[n.offset : n.offset + n.nbytes] = norm  # a replica: the same bytes on every rank
        metadata = metadata_for(seg, step=4, global_shapes={"w.exp_avg": ([8, 8], [4 * rank, 0])})
        handles.append(coordinator.start(seg.source("job", 4, rank=rank, world_size=2, metadata_json=metadata)))
    assert all(h.wait(20).state is SnapshotState.DURABLE for h in handles)
    return coordinator, [seg.tensors()["w.exp_avg"] for seg in olds], norm


def test_the_same_world_size_at_another_layout_is_resharded(make_segment, make_coordinator):
    """A job saved with FSDP on 2 ranks resumes on 2 ranks that hold whole tensors (DDP): the
    world size is the snapshot's, the layout is not. With the trainer's placement each rank
    gets the whole tensor from both old ranks' shards; without it, the refusal names the tensor."""
    coordinator, shards, norm = _fsdp_pair(make_segment, make_coordinator)
    target = make_segment("whole", specs=WHOLE)
    target.fill(99)
    before = target.tensor_area()
    with pytest.raises(SnapshotLayoutMismatch, match=r"tensor 'w.exp_avg' is float32\[4, 8\], the segment's is "
                                                      r"float32\[8, 8\]"):
        restore(coordinator.local, "latest", target.mm, target.layout,
                header=target.header, job_id="job", rank=1, world_size=2)
    assert target.tensor_area() == before
    result = restore(coordinator.local, "latest", target.mm, target.layout,
                     header=target.header, job_id="job", rank=1, world_size=2,
                     placement_json=metadata_for(target, step=4))
    assert target.tensors() == {"w.exp_avg": shards[0] + shards[1], "n.exp_avg": norm}
    assert (result.step, result.snapshot_world_size, sorted(result.source_ranks)) == (4, 2, [0, 1])


def test_a_reshard_plans_from_the_steps_layout_index_checked_first(make_segment, make_coordinator):
    """A whole job's commit writes ``layout.json`` beside its files, listed with its size and
    crc32 in ``snapshot.json``; a reshard plans from it, and one that changed is refused,
    naming it, before the segment changes."""
    coordinator, shards, _ = _fsdp_pair(make_segment, make_coordinator)
    info = coordinator.local.resolve("job/step-4")
    assert info.index.layout is not None
    assert (info.path / LAYOUT_NAME).stat().st_size == info.index.layout.bytes
    target = make_segment("one", specs=WHOLE)  # resumed on one rank
    target.fill(99)
    before = target.tensor_area()
    flip_byte(info.path / LAYOUT_NAME, 20)
    with pytest.raises(SnapshotCorruptError, match=r"layout.json does not match its checksum"):
        restore(coordinator.local, "latest", target.mm, target.layout,
                header=target.header, job_id="job", rank=0, world_size=1,
                placement_json=metadata_for(target, step=4))
    assert target.tensor_area() == before
    flip_byte(info.path / LAYOUT_NAME, 20)  # back as written
    result = restore(coordinator.local, "latest", target.mm, target.layout,
                     header=target.header, job_id="job", rank=0, world_size=1,
                     placement_json=metadata_for(target, step=4))
    assert target.tensors()["w.exp_avg"] == shards[0] + shards[1]
    assert result.plan == "layout-index"
