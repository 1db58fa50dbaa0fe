"""What the store costs in requests, counted on a real directory store with the server's own
uploader: 64 ranks on 4 hosts upload two steps; a fresh server then finds ``latest``. The counts
are of :class:`ObjectStore` calls, each one S3 request (``get_range``: two, a HEAD and the GET;
a listing: one per thousand keys). Bars (the scale issue): an upload at most 10 requests per
rank, ``latest`` on a fresh server at most 20, neither growing with the number of ranks."""

from __future__ import annotations

import pytest

from bench.store_requests import JOB, count_requests
from swap_state.common.snapshot_format import LAYOUT_NAME, step_dir_name
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex
from swap_state.server.snapshot.restoring.reshard import TargetTensor

HOSTS, RANKS_PER_HOST = 4, 16
WORLD = HOSTS * RANKS_PER_HOST


@pytest.mark.timeout(120)
def test_uploads_and_latest_cost_requests_that_do_not_grow_with_the_ranks(tmp_path):
    counted = count_requests(tmp_path, WORLD, RANKS_PER_HOST)
    assert counted.upload_per_rank <= 10, (counted.upload_per_rank, counted.upload)
    # Data, manifest, marker per rank, a part and a names object per host; per step the claim,
    # the layout index and the index, by the host that saw every part (it reads the parts and
    # the one names object, no rank's marker or manifest: O(hosts), not O(ranks)).
    assert (counted.upload["put"], counted.upload["create"]) == (2 * (3 * WORLD + 2 * HOSTS + 2), 2), counted.upload
    assert counted.store.read["marker"] == counted.store.read["manifest"] == 0, counted.store.read
    assert (counted.store.read["part"], counted.store.read["names"]) == (2 * HOSTS, 2), counted.store.read
    layout = StoredSnapshots(counted.store).store.get(f"{JOB}/{step_dir_name(5)}/{LAYOUT_NAME}")
    assert LayoutIndex.from_bytes(layout, WORLD).plan(
        [TargetTensor("w", "float32", (WORLD,), (WORLD,), (0,))], target_rank=0, same_world=False
    )["w"][-1].source_rank == WORLD - 1
    # A fresh reader: a folder listing, the indexes, the names of step 7 (half uploaded).
    assert counted.latest_step == 5
    assert counted.latest_requests <= 20, counted.latest
    assert counted.latest["get"] <= 3, counted.latest  # step 7's first marker, step 7's and 5's index
