"""The snapshot store (``--snapshot-store``): several real server processes stand for hosts,
each with its own shm and snapshot directories, all with one store: a directory (a shared
filesystem) or a real S3 endpoint (moto's server, a process). A host is lost (its server
stopped, its directories deleted) and its ranks resume on a new host from the store, bitwise
as if uninterrupted; statuses, listings, a corrupt object and an unreachable store say what
they should."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

import grpc
import pytest
import torch

from swap_state.client.errors import StoreUnavailableError
from swap_state.client.remote.rpc import ClientConfig, SnapshotHandle, SwapStateClient, SwapStateError
from swap_state.client.remote.container import RemoteSwapOptimizersContainer
from swap_state.common.object_store import open_store
from swap_state.common.retry import wait_until
from swap_state.common.stored_snapshots import StoredSnapshots

from snapshot_kit import params_copy, reference, swap_state_cli
from .test_server_metrics import _free_port, _scrape
from .workload import Workload, build, mismatches, remote, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORLD = 4
HOSTS = {"a": (0, 1), "b": (2, 3)}
WORK = {rank: Workload(seed=rank) for rank in range(WORLD)}  # distinct data per rank


@pytest.fixture
def hosts_shm():
    """A folder in /dev/shm for the hosts' shm directories, removed afterwards."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-hosts-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _host(start_server, hosts_shm, tmp_path, name: str, store: str, **settings):
    """Host ``name``: its own server, shm directory (in /dev/shm) and snapshot directory; the
    same name again is the same host restarted (same directories)."""
    shm = hosts_shm / name
    shm.mkdir(exist_ok=True)
    return start_server(snapshot_dir=tmp_path / f"{name}-snapshots", shm_dir=str(shm),
                        snapshot_store=store, snapshot_store_timeout=5.0, **settings)


def _containers(servers: dict, job: str):
    models, containers = {}, {}
    for host, ranks in HOSTS.items():
        for rank in ranks:
            models[rank] = build(WORK[rank])
            containers[rank] = remote(WORK[rank], models[rank], servers[host].address, job, rank=rank,
                                      world_size=WORLD, local_world_size=len(ranks))
    return models, containers


def _list(address: str, job: str):
    client = SwapStateClient(ClientConfig(address))
    try:
        return list(client.list_snapshots(job).snapshots)
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["path", "s3"])
def test_a_lost_hosts_ranks_resume_from_the_store_on_a_new_host(kind, start_server, hosts_shm, tmp_path, request):
    store = str(tmp_path / "store") if kind == "path" else request.getfixturevalue("s3_store")
    servers = {host: _host(start_server, hosts_shm, tmp_path, host, store) for host in HOSTS}
    models, containers = _containers(servers, "lost")
    try:
        for rank in range(WORLD):
            train(models[rank], containers[rank], WORK[rank], range(1, 6))
        params_at_5 = {rank: params_copy(models[rank]) for rank in range(WORLD)}
        handles = {rank: containers[rank].snapshot() for rank in range(WORLD)}
        for rank, handle in handles.items():
            status = handle.wait_stored(timeout_s=60)
            assert (status.state, status.store_state) == ("stored", "stored"), status
            assert status.store_path.endswith("lost/step-000000000005"), status.store_path
            assert status.bytes_stored == status.bytes_total or status.bytes_stored > 0
        for rank in HOSTS["b"]:
            containers.pop(rank).close()
        servers["b"].stop()  # host b is lost, and its disks with it
        shutil.rmtree(tmp_path / "b-snapshots")
        shutil.rmtree(hosts_shm / "b")

        servers["c"] = _host(start_server, hosts_shm, tmp_path, "c", store)
        [listed] = _list(servers["c"].address, "lost")
        assert (listed.snapshot_id, listed.local, listed.stored, listed.latest) == ("lost/step-5", False, True, True)
        assert listed.ranks == list(range(WORLD)) and listed.store_path.startswith(store.rstrip("/"))
        for rank in HOSTS["b"]:
            models[rank] = build(WORK[rank])
            containers[rank] = remote(WORK[rank], models[rank], servers["c"].address, "lost", rank=rank,
                                      world_size=WORLD, local_world_size=2)
        for rank in range(WORLD):
            if rank in HOSTS["a"]:
                train(models[rank], containers[rank], WORK[rank], range(6, 8))  # diverge, then go back
            assert containers[rank].restore("latest") == 5
            models[rank].load_state_dict(params_at_5[rank])
            train(models[rank], containers[rank], WORK[rank], range(6, 11))
            ref_model, ref_opt = reference(WORK[rank], build, 10)
            assert mismatches(models[rank], containers[rank], ref_model, ref_opt) == [], rank
        log = servers["c"].log_text()
        assert "restore_assembled" in log and "source=store" in log, log[-3000:]
    finally:
        for container in containers.values():
            container.close()


def test_a_corrupt_object_fails_the_restore_with_data_loss_naming_it(start_server, hosts_shm, tmp_path):
    store = tmp_path / "store"
    servers = {host: _host(start_server, hosts_shm, tmp_path, host, str(store)) for host in HOSTS}
    models, containers = _containers(servers, "rot")
    try:
        for rank in range(WORLD):
            train(models[rank], containers[rank], WORK[rank], range(1, 3))
        for handle in [containers[rank].snapshot() for rank in range(WORLD)]:
            handle.wait_stored(timeout_s=60)
        data = store / "rot" / "step-000000000002" / "rank-00003.safetensors"
        raw = bytearray(data.read_bytes())
        raw[-5] ^= 0x40  # inside the last tensor
        data.write_bytes(bytes(raw))
        containers.pop(3).close()
        servers["c"] = _host(start_server, hosts_shm, tmp_path, "c", str(store))
        model = build(WORK[3])
        containers[3] = remote(WORK[3], model, servers["c"].address, "rot", rank=3, world_size=WORLD,
                               local_world_size=2)
        before = params_copy(model)
        with pytest.raises(SwapStateError) as caught:
            containers[3].restore("rot/step-2")
        assert caught.value.code == grpc.StatusCode.DATA_LOSS, servers["c"].log_text()[-3000:]
        assert "rank-00003.safetensors" in str(caught.value) and "fails its checksum" in str(caught.value)
        assert "tensor" in str(caught.value)
        assert all((params_copy(model)[k] == v).all() for k, v in before.items())
    finally:
        for container in containers.values():
            container.close()


def test_an_unreachable_store_fails_stored_naming_it_while_the_snapshot_stays_durable(start_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    store = "s3://nowhere-bucket/snapshots"
    server = start_server(snapshot_store=store, snapshot_store_timeout="2")
    w = Workload()
    model = build(w)
    container = remote(w, model, server.address, "unreach")
    try:
        train(model, container, w, range(1, 3))
        handle = container.snapshot()
        assert handle.wait_durable(timeout_s=30).state in ("durable", "stored")
        with pytest.raises(SwapStateError) as caught:
            handle.wait_stored(timeout_s=60)
        message = str(caught.value)
        assert "durable but not stored" in message and store in message and "--snapshot-store" in message
        train(model, container, w, range(3, 6))  # training goes on
        with pytest.raises(StoreUnavailableError, match=r"'latest' cannot be resolved.*restore unreach/step-2"):
            container.restore("latest")  # the store may hold a newer step: never a silent rewind
        assert container.restore("unreach/step-2") == 2  # from the local tier, named
    finally:
        container.close()


def test_an_unreachable_store_is_never_no_snapshot(start_server, hosts_shm, tmp_path):
    """Issue 48 item 2: host A uploads steps 3 and 6 to a file:// store and is lost; with the
    store unreachable (its root replaced by a file), host B's demo with --resume latest or auto
    fails naming the store instead of starting over (auto trained from step 1), listings and
    Restore say the store could not be read; once the store is back, latest restores step 6."""
    store = tmp_path / "store"
    demo = [sys.executable, "-m", "swap_state.client.demo", "--job-id", "moved", "--steps", "6",
            "--snapshot-every", "3", "--state-dir", str(tmp_path / "state")]
    host_a = _host(start_server, hosts_shm, tmp_path, "a", f"file://{store}")
    first = subprocess.run([*demo, "--server", host_a.address], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    client = SwapStateClient(ClientConfig(host_a.address))
    for step in (3, 6):
        SnapshotHandle(f"moved/step-{step}", step, 0, client).wait_stored(timeout_s=60)
    client.close()
    host_a.kill()  # host A is lost

    host_b = _host(start_server, hosts_shm, tmp_path, "b", f"file://{store}")
    store.rename(tmp_path / "store-away")
    store.write_text("not a directory")  # the store unreachable: its root replaced by a file
    for mode in ("latest", "auto"):
        resumed = subprocess.run([*demo, "--server", host_b.address, "--resume", mode],
                                 capture_output=True, text=True, timeout=120)
        assert resumed.returncode != 0, resumed.stdout
        assert "step    1" not in resumed.stdout  # never trained from the start
        assert "snapshot store could not be read" in resumed.stderr and str(store) in resumed.stderr, resumed.stderr
    listed = swap_state_cli("snapshots", "--server", host_b.address, "--job-id", "moved")
    assert listed.returncode == 3 and str(store) in listed.stderr, (listed.stdout, listed.stderr)
    client = SwapStateClient(ClientConfig(host_b.address))
    reply = client.list_snapshots("moved")
    client.close()
    assert list(reply.snapshots) == [] and str(store) in reply.store_error

    store.unlink()
    (tmp_path / "store-away").rename(store)  # the store is back
    back = subprocess.run([*demo, "--server", host_b.address, "--resume", "latest"],
                          capture_output=True, text=True, timeout=120)
    assert back.returncode == 0, back.stderr
    assert "restored the latest snapshot: step 6" in back.stdout, back.stdout


def test_snapshots_cli_and_metrics_show_both_tiers(start_server, hosts_shm, tmp_path):
    store = tmp_path / "store"
    port = _free_port()
    server = _host(start_server, hosts_shm, tmp_path, "solo", str(store), metrics_port=f"127.0.0.1:{port}")
    w = Workload()
    model = build(w)
    container = remote(w, model, server.address, "tiers")
    try:
        train(model, container, w, range(1, 3))
        container.snapshot().wait_stored(timeout_s=60)
    finally:
        container.close()
    metrics = _scrape(port)
    assert (metrics["swap_state_store_ranks_stored_total"], metrics["swap_state_store_ranks_failed_total"]) == (1, 0)
    assert metrics["swap_state_store_bytes_total"] > 0
    listed = swap_state_cli("snapshots", "--server", server.address, "--job-id", "tiers")
    assert listed.returncode == 0, listed.stderr
    assert "tiers/step-2" in listed.stdout and "local+store" in listed.stdout, listed.stdout
    assert [o.key for o in open_store(str(store)).list("tiers/")] == [
        "tiers/step-000000000002/host-00000-00001-of-00001.part.json",  # the host's part, after its markers
        "tiers/step-000000000002/layout.json",  # the step's layout index, put before its index
        "tiers/step-000000000002/publishing.attempt-1",  # the claim of the host that put them
        "tiers/step-000000000002/rank-00000.manifest.json",
        "tiers/step-000000000002/rank-00000.safetensors",
        "tiers/step-000000000002/rank-00000.stored.json",
        "tiers/step-000000000002/snapshot.json",  # the step's index: every rank was there
    ]


def _stored_steps(store: str, job: str) -> list[int]:
    return [info.step for info in StoredSnapshots(open_store(store)).list(job)]


def test_a_server_killed_mid_upload_leaves_nothing_partial_and_its_successor_uploads(start_server, hosts_shm, tmp_path):
    """SIGKILL while the upload crawls (--snapshot-store-max-bandwidth): the store lists
    nothing, and the next server on the same directories uploads the snapshot again."""
    store = str(tmp_path / "store")
    server = _host(start_server, hosts_shm, tmp_path, "k", store, snapshot_store_max_bandwidth="4M")
    torch_model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))  # 32 MiB moments
    container = RemoteSwapOptimizersContainer([torch_model], torch.optim.AdamW, {"lr": 1e-3}, 2,
                                              server=server.address, job_id="killed")
    try:
        torch_model(torch.randn(4, 1024)).sum().backward()
        container.step()
        handle = container.snapshot()
        assert handle.wait_durable(timeout_s=60).store_state == "uploading"
        server.kill()
    finally:
        container.close()
    assert _stored_steps(store, "killed") == []  # nothing complete, nothing listed
    markers = [o.key for o in open_store(store).list("killed/") if o.key.endswith(".stored.json")]
    assert markers == []

    successor = _host(start_server, hosts_shm, tmp_path, "k", store)  # the same host, restarted
    assert wait_until(lambda: _stored_steps(store, "killed") == [1], timeout_s=60), successor.log_text()[-3000:]
    assert "store_upload_resumed" in successor.log_text()
    [listed] = _list(successor.address, "killed")
    assert (listed.local, listed.stored) == (True, True)


def test_retention_applies_to_the_store_and_keeps_the_newest(start_server, hosts_shm, tmp_path):
    store = str(tmp_path / "store")
    server = _host(start_server, hosts_shm, tmp_path, "r", store)
    w = Workload()
    model = build(w)
    container = remote(w, model, server.address, "kept")
    try:
        for step in (2, 4, 6):
            train(model, container, w, range(step - 1, step + 1))
            container.snapshot().wait_stored(timeout_s=60)
    finally:
        container.close()
    # The server keeps 2 (--keep-latest): steps 4 and 6, in both tiers; nothing of step 2 left.
    # Step 2 stops being listed when its index and markers go, before its data: wait for both.
    gone = lambda: not open_store(store).list("kept/step-000000000002/")  # noqa: E731
    assert wait_until(lambda: _stored_steps(store, "kept") == [4, 6] and gone(), timeout_s=30), (
        _stored_steps(store, "kept"), open_store(store).list("kept/step-000000000002/"))
    assert [s.step for s in _list(server.address, "kept")] == [4, 6]


def test_snapshots_faster_than_the_store_upload_only_the_newest(start_server, hosts_shm, tmp_path):
    store = str(tmp_path / "store")
    server = _host(start_server, hosts_shm, tmp_path, "q", store, snapshot_store_max_bandwidth="4M")
    model = torch.nn.Linear(1024, 1024)  # 8 MiB of moments: about 2 s per upload at 4 MB/s
    container = RemoteSwapOptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-3}, 2,
                                              server=server.address, job_id="queued")
    try:
        handles = []
        for _ in range(3):
            model(torch.randn(4, 1024)).sum().backward()
            container.step()
            container.zero_grad()
            handles.append(container.snapshot())
            handles[-1].wait_durable(timeout_s=60)
        assert handles[2].wait_stored(timeout_s=60).state == "stored"
        with pytest.raises(SwapStateError, match="only the newest of a job is uploaded"):
            handles[1].wait_stored(timeout_s=60)
        assert handles[0].wait_stored(timeout_s=60).state == "stored"  # it was already going up
    finally:
        container.close()
    assert _stored_steps(store, "queued") == [1, 3]
