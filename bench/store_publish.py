"""What publishing one step costs the host that publishes it (used by ``python -m bench.scale
--publish-ranks``): CPU seconds, peak Python memory and store requests of
:meth:`~swap_state.server.snapshot.tiers.store.StoreTier.publish_step_index`, at N ranks on N / 8
hosts of a layout of :mod:`bench.scale`, on a real directory store counted per call as S3
requests (:class:`~bench.store_requests.CountingStore`).

- **after**: the store as the hosts leave it now: every rank's marker, every host's part (its
  ranks' files and their part of the layout index; built per kind of tensor, as
  :func:`bench.scale.layout_json` does, then named for every tensor: the same part a host builds
  from its ranks' records, which 16,384 ranks of 3,411 tensors would take minutes to make here),
  one ``layout-names`` object. The publisher lists, claims, reads the parts, merges
  ``layout.json`` (checked equal to :func:`bench.scale.layout_json`) and puts it and the index.
  Also: what one host pays for its own part (its 8 ranks' records to part, real records), and
  what a host that finishes at the same moment pays when the claim is taken.
- **before**: the store as hosts left it before host parts (markers, every rank's manifest) and
  the publish of that code, replayed: every marker read (``complete_info``), every manifest read
  and parsed, ``LayoutIndex`` built from all their records (the old ``StoreTier._built_layout``).
  Data files are not put (the publisher never reads them).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

from bench.store_requests import CountingStore
from swap_state.common.checksum import crc32
from swap_state.common.object_store import PosixObjectStore
from swap_state.common.snapshot_format import FileRecord, SnapshotIndex, dumps_json, rank_data_name, rank_manifest_name
from swap_state.common.stored_snapshots import StoredSnapshots, marker_name
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, layout_part
from swap_state.server.snapshot.tiers.seam import StepPlan
from swap_state.server.snapshot.tiers.store import StoreTier

JOB, STEP, RANKS_PER_HOST = "job", 1000, 8  # as bench.scale.rank_manifest names them


def _files(rank: int, manifest: tuple[int, int] = (1, 0)) -> tuple[FileRecord, FileRecord]:
    return FileRecord(rank_data_name(rank), rank, 1 << 30, rank), FileRecord(rank_manifest_name(rank), rank, *manifest)


def _put_markers(store: CountingStore, world: int, manifests: dict[int, tuple[int, int]] | None = None) -> None:
    """Every rank's marker (``manifests``: each manifest's size and crc32, when put)."""
    for rank in range(world):
        files = _files(rank, (manifests or {}).get(rank, (1, 0)))
        marker = SnapshotIndex(JOB, STEP, world, (rank,), files, 1.0)
        store.put(StoredSnapshots.step_prefix(JOB, STEP) + marker_name(rank), dumps_json(marker.to_json()))


def host_part(layout, world: int, ranks: range, cache: dict) -> tuple[list, list[str], list[int]]:
    """A host's part of the layout index, from one tensor per kind (shape and cut), named for all."""
    from bench.scale import Layout, MOMENTS, rank_records

    kinds: dict[tuple, list[str]] = {}
    for fqn, kind in layout.params.items():
        kinds.setdefault(kind, []).append(fqn)
    sample = Layout({fqns[0]: kind for kind, fqns in kinds.items()}, layout.tp, layout.steps)
    part_kinds, names, kind_of = layout_part({r: rank_records(sample, world, r) for r in ranks})
    key = (tuple(names), tuple(kind_of))
    if key not in cache:  # every tensor named: it is the kind its kind's sample is
        of = dict(zip(names, kind_of))
        suffixes = (*MOMENTS, *(("step",) if layout.steps else ()))
        every = {f"state.{fqn}.{s}": of[f"state.{fqns[0]}.{s}"] for fqns in kinds.values() for fqn in fqns for s in suffixes}
        cache[key] = (sorted(every), [every[name] for name in sorted(every)])
    return part_kinds, *cache[key]


def setup_after(root: pathlib.Path, layout, world: int) -> CountingStore:
    store = CountingStore(root)
    store.create_root()
    _put_markers(store, world)
    tier, cache = StoreTier(StoredSnapshots(store)), {}
    for first in range(0, world, RANKS_PER_HOST):
        ranks = tuple(range(first, first + RANKS_PER_HOST))
        files = tuple(f for r in ranks for f in _files(r))
        plan = StepPlan(JOB, STEP, world, ranks, "", None, source=SnapshotIndex(JOB, STEP, world, ranks, files, 1.0))
        tier.put_part(plan, host_part(layout, world, range(first, first + RANKS_PER_HOST), cache))
    return store


def setup_before(root: pathlib.Path, layout, world: int) -> CountingStore:
    from bench.scale import rank_manifest, rank_records

    store = CountingStore(root)
    store.create_root()
    sizes = {}
    for rank in range(world):
        manifest = rank_manifest(layout, world, rank, rank_records(layout, world, rank))
        raw = dataclasses.replace(manifest, data_file=rank_data_name(rank)).to_bytes()
        store.put(StoredSnapshots.step_prefix(JOB, STEP) + rank_manifest_name(rank), raw)
        sizes[rank] = (len(raw), crc32(raw))
    _put_markers(store, world, sizes)
    return store


def publish_after(root: pathlib.Path, world: int) -> tuple[CountingStore, bytes]:
    """Publish from a fresh reader over the store (claim given back first): its store, layout.json."""
    prefix = StoredSnapshots.step_prefix(JOB, STEP)
    store = CountingStore(root)
    for name in ("snapshot.json", "layout.json", "publishing.attempt-1"):
        store.delete(prefix + name)
    store.calls.clear()
    assert StoreTier(StoredSnapshots(store)).publish_step_index(JOB, STEP, 1, world) is True
    return store, PosixObjectStore(root).get(prefix + "layout.json")  # read here: not the publisher's


def publish_before(root: pathlib.Path, world: int) -> tuple[CountingStore, bytes]:
    """The publish before host parts, replayed: every marker, every manifest, the build."""
    store = CountingStore(root)
    stored = StoredSnapshots(store)
    info = stored.complete_info(JOB, STEP, stored.list_step(JOB, STEP))  # no parts: every marker read
    assert info is not None
    raw = LayoutIndex({r: stored.read_manifest(info, r).tensors for r in info.ranks}, world).to_bytes()
    return store, raw


def late_host(root: pathlib.Path, world: int) -> CountingStore:
    """A host that sees every part once the claim is taken (the index not yet put)."""
    prefix = StoredSnapshots.step_prefix(JOB, STEP)
    store = CountingStore(root)
    store.delete(prefix + "snapshot.json")
    store.calls.clear()
    assert StoreTier(StoredSnapshots(store)).publish_step_index(JOB, STEP, 1, world) is True
    return store


def latest_unpublished(root: pathlib.Path) -> CountingStore:
    """``latest`` from a fresh reader when the newest step has no index (nor layout.json)."""
    prefix = StoredSnapshots.step_prefix(JOB, STEP)
    for name in ("snapshot.json", "layout.json"):
        PosixObjectStore(root).delete(prefix + name)
    store = CountingStore(root)
    assert StoredSnapshots(store).resolve("latest", JOB).step == STEP
    return store


def own_part(layout, world: int) -> tuple[int, int]:
    """One host's part from its 8 ranks' real records: (part bytes, names object bytes)."""
    from bench.scale import rank_records

    kinds, names, kind_of = layout_part({r: rank_records(layout, world, r) for r in range(RANKS_PER_HOST)})
    return len(json.dumps(kinds, separators=(",", ":"))), len(json.dumps({"names": names, "kind_of": kind_of},
                                                                         separators=(",", ":")))


def clean(root: pathlib.Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
