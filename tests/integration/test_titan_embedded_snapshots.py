"""The embedded server's snapshots last: they go to ``EmbeddedServerConfig.snapshot_dir`` (not
the server's temp directory, which keeps only the socket and log), so a new embedded server
with the same directory restores them; the first snapshot says (INFO) where it goes."""

from __future__ import annotations

import logging
import os

import pytest

from swap_state.client.errors import SnapshotNotFoundError
from swap_state.client.remote.embedded import EmbeddedServerConfig
from swap_state.client.optim.checkpoint_template import SNAPSHOT_REF_KEY

from snapshot_kit import CHUNK, params_copy
from .workload import Workload, build, reference_mismatches, remote, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

W = Workload()


def _embedded(snapshot_dir, shm_dir) -> EmbeddedServerConfig:
    return EmbeddedServerConfig(snapshot_dir=str(snapshot_dir), server={"shm_dir": shm_dir, "chunk_bytes": CHUNK})


def test_snapshots_of_an_embedded_server_outlive_it(no_server_env, private_shm_dir, tmp_path, caplog):
    snapshots = tmp_path / "snapshots"
    model = build(W)
    first = remote(W, model, None, "lasting", checkpoint="snapshot", embedded=_embedded(snapshots, private_shm_dir))
    workdir = first.segment.embedded.workdir
    assert first.segment.embedded.snapshot_dir == str(snapshots)
    train(model, first, W, range(1, 6))
    params_at_5 = params_copy(model)
    with caplog.at_level(logging.INFO, logger="swap_state.client"):
        saved = first.state_dict()
        first.segment.snapshot_handle.wait_durable(timeout_s=60)
    assert saved[SNAPSHOT_REF_KEY] == "lasting/step-5"
    where = [r.getMessage() for r in caplog.records if "first snapshot" in r.getMessage()]
    assert where == [f"first snapshot lasting/step-5 goes to {snapshots / 'lasting'}"]
    assert set(os.listdir(workdir)) <= {"server.log", "swap-state.sock", "swap-state.sock.lock", ".owner-pid",
                                        "swap-state.sock.callers"}  # the trainer's uid proof (docs/security.md)
    first.close()  # stops the embedded server
    assert not os.path.exists(workdir)
    assert (snapshots / "lasting" / "step-000000000005").is_dir()

    again = build(Workload(seed=7))
    again.load_state_dict(params_at_5)
    second = remote(W, again, None, "rerun", checkpoint="snapshot", embedded=_embedded(snapshots, private_shm_dir))
    assert second.segment.embedded.address != first.remote_config.server
    second.load_state_dict(saved)
    assert second.session.last_committed_step == 5
    train(again, second, W, range(6, 11))
    assert reference_mismatches(again, second, W) == []
    second.close()


def test_a_resume_at_another_world_size_on_embedded_servers_says_what_to_do(no_server_env, private_shm_dir, tmp_path):
    """Each rank of a 2-rank job has an embedded server of its own (snapshots in
    <dir>/rank-0000N); a 1-rank rerun's embedded server has none of them, and says why and
    what works instead (a host's server with a store, or an export)."""
    snapshots = tmp_path / "snapshots"
    models = [build(W), build(W)]
    ranks = [remote(W, models[rank], None, "two-embedded", checkpoint="snapshot", rank=rank, world_size=2,
                    embedded=_embedded(snapshots, private_shm_dir)) for rank in range(2)]
    for model, container in zip(models, ranks):
        train(model, container, W, range(1, 3))
        container.snapshot().wait_durable(timeout_s=60)
        container.close()
    assert sorted(p.name for p in snapshots.iterdir() if p.is_dir()) == ["rank-00000", "rank-00001"]
    alone = remote(W, build(W), None, "two-embedded", checkpoint="snapshot", embedded=_embedded(snapshots, private_shm_dir))
    with pytest.raises(SnapshotNotFoundError) as raised:
        alone.restore("two-embedded/step-2")
    message = str(raised.value)
    assert f"taken by 2 ranks' embedded servers, in {snapshots}/rank-*" in message, message
    assert "--snapshot-store" in message and f"--format torchtitan --snapshot-dir {snapshots}" in message, message
    alone.close()
