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

With ``optimizer.swap_state_replica_interval`` the job checkpoints between torchtitan's own saves
with memory-only snapshots (in a host's memory and its peer's, never on disk): a lost host
resumes from the newest of them, and one whose snapshot is gone is passed over on load.
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
from swap_state.client.torchtitan.checkpointing import MEMORY_ONLY_MARKER
from test_swap_state_trainer import CHECKPOINT, N, SCHEDULE, _loaded, remote
from test_titan_resume_anywhere import NO_DATALOADER
from titan_testkit import STOP_AFTER_STEP_ENV, free_port

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


def _folders(dump: pathlib.Path) -> dict[str, str | None]:
    """torchtitan's checkpoint folders under ``dump``: the memory-only snapshot each marks, else None."""
    return {path.name: (path / MEMORY_ONLY_MARKER).read_text() if (path / MEMORY_ONLY_MARKER).exists() else None
            for path in sorted((dump / "ckpt").iterdir())}


@pytest.mark.timeout(300)
def test_a_lost_hosts_job_resumes_from_a_memory_only_checkpoint_with_plain_torchtitans_losses(run_trainer, hosts,
                                                                                              tmp_path):
    """2 hosts x 1 rank (one trainer process a host: the 2-core CI machine runs 2, and each
    host's rank takes the same path as 2 would), torchtitan's checkpoints every 3 steps and a
    memory-only one every step, keep_latest_k = 2. The job stops after step 5: its folders are
    torchtitan's step 3 and the memory-only step 5 (1, 2 and 4 removed before torchtitan's purge,
    which would have taken step 3). Host a is lost; on b (2 ranks, no --checkpoint.load_step)
    torchtitan loads step 5 from b's memory and a's replica there, and step 6's loss equals
    plain torchtitan's resuming its own step-5 checkpoint (2 ranks)."""
    a, b = hosts["a"].server, hosts["b"].server
    swap = (*remote(None, "snapshot", job_id=JOB), "--optimizer.swap_state_replica_interval=1",
            "--checkpoint.keep_latest_k=2")
    # Plain torchtitan checkpointing at step 5, stopped there and resumed.
    plain_flags = (SCHEDULE, *CHECKPOINT[:2], "--checkpoint.interval=5", CHECKPOINT[3])
    plain = run_trainer(tmp_path / "plain", *plain_flags, steps=2 * N, nproc=2, env={STOP_AFTER_STEP_ENV: "5"})
    plain_resumed = run_trainer(tmp_path / "plain", *plain_flags, steps=2 * N, nproc=2)
    assert _loaded(plain_resumed.run.output, tmp_path / "plain", step=5) and plain_resumed.steps == [6], \
        plain_resumed.run.output[-3000:]
    first = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, steps=2 * N, nproc=2, hosts=_on(a, b),
                        env={STOP_AFTER_STEP_ENV: "5"})
    assert first.steps == [1, 2, 3, 4, 5] and first == plain, f"{first} != {plain}\n{first.run.output[-3000:]}"
    assert _folders(tmp_path / "swap") == {"step-3": None, "step-5": f"{JOB}/step-5"}
    for server, rank in ((a, 0), (b, 1)):
        _wait_replicated(server, f"{JOB}/step-5", range(rank, rank + 1))
    assert not [path for host in hosts.values() for path in host.snapshots.rglob("step-*5")]  # never on disk
    a.kill()
    shutil.rmtree(hosts["a"].shm)
    shutil.rmtree(hosts["a"].snapshots)

    on_b = run_trainer(tmp_path / "swap", SCHEDULE, *CHECKPOINT, *swap, "--checkpoint.load_only", steps=2 * N,
                       nproc=2, hosts=_on(b))
    assert _loaded(on_b.run.output, tmp_path / "swap", step=5), on_b.run.output[-3000:]
    assert on_b.steps == [6] and on_b == plain_resumed, f"{on_b} != {plain_resumed}\n{b.log_text()[-3000:]}"
    restores = _restores(b)
    assert sorted(restores) == [0, 1] and {r["snapshot_id"] for r in restores.values()} == {f"{JOB}/step-5"}, restores


@pytest.mark.timeout(240)
def test_a_memory_only_checkpoint_whose_snapshot_is_gone_is_passed_over_on_load(run_trainer, hosts, start_server,
                                                                                tmp_path):
    """1 rank on host a, torchtitan's checkpoints every 3 steps, memory-only ones every 2, stopped
    after step 4. Host a's server restarts on its disk with its memory lost and no
    --replica-peers (b's replica out of reach): the rerun passes over the memory-only step 4,
    saying so, loads torchtitan's step 3 and trains step 4 as the job did; step 4's save (the
    last step's, persisted) unmarks its folder."""
    a = hosts["a"]
    job = "titan-replica-gone"
    first = run_trainer(tmp_path, SCHEDULE, *CHECKPOINT, *remote(a.server, "snapshot", job_id=job),
                        "--optimizer.swap_state_replica_interval=2", steps=2 * N, env={STOP_AFTER_STEP_ENV: "4"})
    assert first.steps == [1, 2, 3, 4]
    assert _folders(tmp_path) == {"step-3": None, "step-4": f"{job}/step-4"}
    a.server.kill()
    shutil.rmtree(a.shm)
    restarted = start_server(shm_size_bytes=512 << 20, snapshot_dir=a.snapshots)
    rerun = run_trainer(tmp_path, SCHEDULE, *CHECKPOINT, *remote(restarted, "snapshot", job_id=job),
                        "--optimizer.swap_state_replica_interval=2", steps=4)
    output = rerun.run.output
    assert f"checkpoint {tmp_path / 'ckpt' / 'step-4'} is passed over: its memory-only snapshot {job}/step-4" in output, \
        output[-3000:]
    assert _loaded(output, tmp_path, step=3), output[-3000:]
    assert rerun.steps == [4] and rerun == first[3:], f"{rerun} != {first}\n{output[-3000:]}"
    assert _folders(tmp_path) == {"step-3": None, "step-4": None}
