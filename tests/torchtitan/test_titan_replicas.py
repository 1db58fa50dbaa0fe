"""torchtitan's own trainer survives the loss of one of its hosts with no store: real server
processes stand for hosts replicating into each other's memory (``--replica-peers``).

A job of 2 hosts x 2 ranks (two torchrun launches, ``--nnodes 2``, one rendezvous; gloo, FSDP2
over the 4 ranks) trains N steps: ranks 0-1 talk to host a's server, ranks 2-3 to host b's, and
each server replicates its ranks' snapshots into the other's memory. Its losses equal plain
torchtitan's (AdamW, DCP) bit for bit, and it saves a snapshot-mode checkpoint at N. Host a's
server is SIGKILLed and its shm and snapshot directories wiped. Then the job resumes from that
checkpoint

* on host b alone with 2 ranks (another world size): b assembles each tensor from its own
  snapshot of ranks 2-3 and its replica of a's ranks 0-1; the losses of steps N+1..2N equal
  plain torchtitan's resuming its DCP checkpoint on 2 ranks;
* on a replacement host c with 4 ranks (the same world size): c holds nothing and reads b's
  snapshot and replica over the replica wire (c's ``--replica-peers`` names b); the losses
  equal plain torchtitan's on 4 ranks (which, resuming at the same world size with the
  dataloader, are those of its uninterrupted run).

The resumes load step N (``--checkpoint.load_step``) and save nothing (``--checkpoint.load_only``),
so neither changes what the other restores.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import shutil
import tempfile

import pytest

from swap_state.client.remote.embedded import EmbeddedServer
from swap_state.client.remote.environment import ENV_SERVER
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from test_swap_state_trainer import CHECKPOINT, N, SCHEDULE, remote
from test_titan_resume_anywhere import NO_DATALOADER
from titan_testkit import free_port

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]

JOB = "titan-replica"
#: FSDP over the job's 4 ranks (2 hosts x 2): parameters and moments are DTensor shards of dim 0.
FSDP_4 = ("--parallelism.data_parallel_shard_degree=4",)
#: A resume from step N's checkpoint that saves nothing (no snapshot either).
RESUME_AT_N = (f"--checkpoint.load_step={N}", "--checkpoint.load_only")


@dataclasses.dataclass(frozen=True)
class Host:
    server: EmbeddedServer
    shm: pathlib.Path  # its --shm-dir (segments, and the replicas it holds)
    snapshots: pathlib.Path  # its --snapshot-dir
    replica_listen: str | None


@pytest.fixture
def hosts(start_server, tmp_path) -> dict[str, Host]:
    """Servers a and b, each taking the other's replicas, and a replacement host c that reads
    b's (``--replica-peers`` b, nothing of its own), by name."""
    secret = tmp_path / "replica-secret"
    secret.write_text("a-replica-secret-of-32-bytes-xyz\n")
    os.chmod(secret, 0o600)
    ports = {"a": free_port(), "b": free_port()}
    shm_root = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-titan-hosts-", dir="/dev/shm"))
    started = {}
    for host, peer in (("a", "b"), ("b", "a"), ("c", "b")):
        shm, snapshots = shm_root / host, tmp_path / f"{host}-snapshots"
        shm.mkdir()
        listen = f"tcp://127.0.0.1:{ports[host]}" if host in ports else None
        taking = {"replica_listen": listen, "replica_size": "512M"} if listen else {}
        server = start_server(shm_size_bytes=512 << 20, snapshot_dir=snapshots, shm_dir=str(shm), **taking,
                              replica_peers=f"tcp://127.0.0.1:{ports[peer]}", replica_secret_file=str(secret))
        started[host] = Host(server, shm, snapshots, listen)
    yield started
    shutil.rmtree(shm_root, ignore_errors=True)


def _wait_replicated(server, snapshot_id: str, ranks: range) -> None:
    client = SwapStateClient(ClientConfig(server.address))
    try:
        for rank in ranks:
            status = client.snapshot_status(snapshot_id, rank, wait_s=60, wait_replicated=True)
            assert status.replica_state == "replicated", status
    finally:
        client.close()


def _restores(server: EmbeddedServer) -> dict[int, dict[str, str]]:
    """The fields of the server's restore_assembled events (logfmt), by rank (the last one of each)."""
    restores = {}
    for line in server.log_text().splitlines():
        if "event=restore_assembled" in line:
            fields = dict(part.split("=", 1) for part in shlex.split(line) if "=" in part)
            restores[int(fields["rank"])] = fields
    return restores


def _source_ranks(restores: dict[int, dict[str, str]]) -> set[int]:
    return {int(r) for fields in restores.values() for r in fields["source_ranks"].strip("[]").split(",") if r.strip()}


def _rank_files(folder: pathlib.Path) -> list[int]:
    """The ranks of the snapshot files under ``folder`` (rank-NNNNN.safetensors)."""
    return sorted(int(path.name.split(".")[0].removeprefix("rank-")) for path in folder.rglob("rank-*.safetensors"))


def _on(*servers) -> list[dict[str, str]]:
    """One torchrun launch per server, its ranks talking to that server (its host's)."""
    return [{ENV_SERVER: server.address} for server in servers]


@pytest.mark.timeout(300)
def test_a_lost_hosts_job_resumes_on_the_other_and_on_a_new_host_with_plain_torchtitans_losses(run_trainer, hosts,
                                                                                               tmp_path):
    a, b, c = hosts["a"].server, hosts["b"].server, hosts["c"].server
    swap = remote(None, "snapshot", job_id=JOB)  # each launch's server: $SWAP_STATE_SERVER, its host's
    plain_4 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *FSDP_4, steps=2 * N, nproc=4)
    assert plain_4.steps == list(range(1, 2 * N + 1)), plain_4.run.output[-3000:]
    swap_4 = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, *FSDP_4, steps=N, nproc=4,
                         hosts=_on(a, b))
    assert swap_4.steps == list(range(1, N + 1)) and swap_4 == plain_4[:N], \
        f"{swap_4} != {plain_4}\n{swap_4.run.output[-3000:]}"
    for server, ranks in ((a, range(0, 2)), (b, range(2, 4))):
        _wait_replicated(server, f"{JOB}/step-{N}", ranks)
    # b holds ranks 2-3 of step N on its disk and a's ranks 0-1 in its memory, nothing else.
    assert _rank_files(hosts["b"].snapshots) == [2, 3] and _rank_files(hosts["b"].shm) == [0, 1]
    a.kill()  # host a is lost, its memory and disks with it
    shutil.rmtree(hosts["a"].shm)
    shutil.rmtree(hosts["a"].snapshots)

    # Host b alone, 2 ranks: b assembles each tensor from the 4 ranks' FSDP shards, ranks 2-3's
    # from its disk, ranks 0-1's from its memory (a's replica).
    plain_2 = run_trainer(tmp_path / "plain", SCHEDULE, *CHECKPOINT, *RESUME_AT_N, NO_DATALOADER, steps=2 * N,
                          nproc=2)
    on_b = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *RESUME_AT_N, *swap, NO_DATALOADER, steps=2 * N,
                       nproc=2, hosts=_on(b))
    assert plain_2.steps == list(range(N + 1, 2 * N + 1)), plain_2.run.output[-3000:]
    assert on_b.steps == plain_2.steps and on_b == plain_2, f"{on_b} != {plain_2}\n{b.log_text()[-3000:]}"
    restores = _restores(b)
    assert sorted(restores) == [0, 1], b.log_text()[-3000:]
    assert all((r["snapshot_id"], r["world_size"], r["snapshot_world_size"]) == (f"{JOB}/step-{N}", "2", "4")
               for r in restores.values()), restores
    assert _source_ranks(restores) == {0, 1, 2, 3}, restores

    # A replacement host c, 4 ranks: everything comes from b over the replica wire.
    on_c = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *RESUME_AT_N, *swap, steps=2 * N, nproc=4,
                       hosts=_on(c))
    assert on_c.steps == plain_4.steps[N:] and on_c == plain_4[N:], f"{on_c} != {plain_4[N:]}\n{c.log_text()[-3000:]}"
    restores = _restores(c)
    assert sorted(restores) == [0, 1, 2, 3], c.log_text()[-3000:]
    b_wire = hosts["b"].replica_listen.removeprefix("tcp://")
    assert all((r["world_size"], r["snapshot_world_size"]) == ("4", "4") and r["location"].startswith(f"/{b_wire}/")
               for r in restores.values()), restores
