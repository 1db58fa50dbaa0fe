"""torchtitan's own trainer survives the loss of its host with no store: two real server
processes stand for two hosts replicating into each other's memory (``--replica-peers``).
2 ranks (torchrun, gloo, FSDP2 over both) train N steps on host a and save a snapshot-mode
checkpoint; host a's server is killed and its shm and snapshot directories wiped; the job
resumes on host b on 1 rank (another world size), restoring from b's memory, and its losses
equal plain torchtitan's resuming its own DCP checkpoint, bit for bit (the same world size is
tests/integration/test_replicas.py's).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import tempfile

import pytest

from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from test_swap_state_trainer import CHECKPOINT, N, SCHEDULE, remote
from test_titan_resume_anywhere import FSDP_2, NO_DATALOADER

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]

JOB = "titan-replica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_hosts(start_server, tmp_path):
    """Servers a and b, each taking the other's replicas: {name: (server, shm dir, snapshot dir)}."""
    secret = tmp_path / "replica-secret"
    secret.write_text("a-replica-secret-of-32-bytes-xyz\n")
    os.chmod(secret, 0o600)
    ports = {"a": _free_port(), "b": _free_port()}
    shm_root = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-titan-hosts-", dir="/dev/shm"))
    hosts = {}
    for host, other in (("a", "b"), ("b", "a")):
        shm, snapshots = shm_root / host, tmp_path / f"{host}-snapshots"
        shm.mkdir()
        hosts[host] = (start_server(shm_size_bytes=512 << 20, snapshot_dir=snapshots, shm_dir=str(shm),
                                    replica_listen=f"tcp://127.0.0.1:{ports[host]}", replica_size="512M",
                                    replica_peers=f"tcp://127.0.0.1:{ports[other]}", replica_secret_file=str(secret)),
                       shm, snapshots)
    yield hosts
    shutil.rmtree(shm_root, ignore_errors=True)


def _wait_replicated(server, snapshot_id: str, ranks: range) -> None:
    client = SwapStateClient(ClientConfig(server.address))
    try:
        for rank in ranks:
            status = client.snapshot_status(snapshot_id, rank, wait_s=60, wait_replicated=True)
            assert status.replica_state == "replicated", status
    finally:
        client.close()


@pytest.mark.timeout(600)
def test_a_lost_hosts_job_resumes_from_its_peers_memory_with_plain_torchtitans_losses(run_trainer, two_hosts,
                                                                                        tmp_path):
    (a, a_shm, a_snapshots), (b, _, _) = two_hosts["a"], two_hosts["b"]
    plain_2 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *FSDP_2, steps=N, nproc=2)
    swap_2 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *remote(a, "snapshot", job_id=JOB), *FSDP_2,
                         steps=N, nproc=2)
    assert swap_2.steps == list(range(1, N + 1)) and swap_2 == plain_2
    _wait_replicated(a, f"{JOB}/step-{N}", range(2))
    a.kill()  # host a is lost, its memory and disks with it
    shutil.rmtree(a_shm)
    shutil.rmtree(a_snapshots)

    # On 1 rank (another world size): b assembles each tensor from a's two FSDP shards in its memory.
    plain = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, NO_DATALOADER, steps=2 * N)
    swap = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *remote(b, "snapshot", job_id=JOB), NO_DATALOADER,
                       steps=2 * N)
    assert plain.steps == list(range(N + 1, 2 * N + 1)), plain.run.output[-3000:]
    assert swap == plain, f"{swap} != {plain}\n{b.log_text()[-3000:]}"
    log = b.log_text()
    assert "restore_assembled" in log and "snapshot_world_size=2" in log, log[-3000:]
