"""Tenants (``--tenants``) through a real server process: a second tenant can neither read,
change, roll back nor list a first tenant's job, session or snapshot; an admin sees all; the
ownership outlives a server restart (it is in ``snapshot.json``)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from swap_state.client import errors
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from swap_state.common.names import parse_snapshot_id, step_dir_name
from swap_state.common.retry import wait_until
from swap_state.common.snapshot_format import INDEX_NAME
from swap_state.proto import swap_state_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SPECS = [("state.w.exp_avg", "float32", [64, 64])]
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab", "ops": "ops-token-0123456789abc"}


@pytest.fixture
def server(start_server, tmp_path):
    path = tmp_path / "tenants"
    path.write_text("# tenant token [admin]\n" + "".join(
        f"{name} {token}{' admin' if name == 'ops' else ''}\n" for name, token in TOKENS.items()))
    path.chmod(0o600)
    return start_server(tenants=str(path), free_segments_on_stop=False)


@pytest.fixture
def clients(server):
    made = {name: SwapStateClient(ClientConfig(server.address, token=token, rpc_timeout_s=10.0))
            for name, token in TOKENS.items()}
    yield made
    for client in made.values():
        client.close()


def _snapshot(session, step: int) -> str:
    session.commit(step)
    snapshot_id = session.snapshot(step).snapshot_id
    status = session.client.snapshot_status(snapshot_id, session.rank, wait_s=30.0)
    assert status.state == "durable", status
    return snapshot_id


def _denied(call, *args):
    with pytest.raises(errors.PermissionDeniedError) as info:
        call(*args)
    assert info.value.reason == "PERMISSION_DENIED"
    return info.value


def test_a_tenant_reaches_only_its_own_jobs(server, clients):
    alice, bob, ops = clients["alice"], clients["bob"], clients["ops"]
    mine = alice.attach("train", 0, 1)
    mine.allocate(SPECS)
    snapshot_id = _snapshot(mine, 1)

    # Bob cannot take the job id, nor any rank of it.
    assert "another tenant" in str(_denied(bob.attach, "train", 0, 1))
    _denied(bob.attach, "train", 1, 2)
    # Nor act on Alice's session, even knowing its id and generation.
    sid, gen = mine.session_id, mine.generation
    for name, request in [
        ("Detach", pb.DetachRequest(session_id=sid, generation=gen)),
        ("CommitStep", pb.CommitStepRequest(session_id=sid, generation=gen, step=2)),
        ("Allocate", pb.AllocateRequest(session_id=sid, generation=gen)),
        ("Snapshot", pb.SnapshotRequest(session_id=sid, generation=gen, step=1)),
        ("Restore", pb.RestoreRequest(session_id=sid, generation=gen, snapshot_id="latest")),
    ]:
        _denied(bob.call, name, request)
    # Nor read her snapshot into his own session, nor see it.
    own = bob.attach("other", 0, 1)
    own.allocate(SPECS)
    own.commit(1)
    _denied(own.restore, snapshot_id)
    _denied(bob.snapshot_status, snapshot_id, 0)
    assert [s.snapshot_id for s in bob.list_snapshots().snapshots] == []
    assert [s.snapshot_id for s in alice.list_snapshots().snapshots] == [snapshot_id]
    assert {s.job_id for s in bob.stats().sessions} == {"other"}
    assert {s.job_id for s in alice.stats().sessions} == {"train"}
    # The admin sees every tenant's.
    assert {s.job_id for s in ops.stats().sessions} == {"train", "other"}
    assert [s.snapshot_id for s in ops.list_snapshots().snapshots] == [snapshot_id]
    # Alice's session is untouched: she commits and restores on.
    assert mine.commit(2) == 2
    assert mine.restore(snapshot_id).step == 1

    assert json.loads(_index_path(server, snapshot_id).read_text())["tenant"] == "alice"
    own.close()
    mine.close()


def _index_path(server, snapshot_id: str) -> pathlib.Path:
    ref = parse_snapshot_id(snapshot_id, None, ValueError)
    return pathlib.Path(server.snapshot_dir) / ref.job_id / step_dir_name(ref.step) / INDEX_NAME


def test_ownership_outlives_a_server_restart(server, clients):
    alice, bob = clients["alice"], clients["bob"]
    mine = alice.attach("kept", 0, 1)
    mine.allocate(SPECS)
    snapshot_id = _snapshot(mine, 3)
    mine.close()
    live = alice.attach("live", 0, 1)  # its segment outlives the server: adopted, still Alice's
    live.allocate(SPECS)
    server.restart()
    _denied(bob.attach, "kept", 0, 1)  # from snapshot.json: no session of the job is left
    _denied(bob.attach, "live", 0, 1)  # from the adopted segment's descriptor
    assert {s.job_id for s in bob.stats().sessions} == set()
    assert {s.job_id for s in alice.stats().sessions} == {"live"}
    again = alice.attach("kept", 0, 1)
    again.allocate(SPECS)
    assert again.restore("latest").snapshot_id == snapshot_id
    again.close()
    live.close()


def test_an_unknown_token_is_unauthenticated(server):
    client = SwapStateClient(ClientConfig(server.address, token="no-such-token-0123456789", rpc_timeout_s=10.0))
    try:
        with pytest.raises(errors.UnauthenticatedError):
            client.attach("train", 0, 1)
    finally:
        client.close()


def test_quotas_bound_one_tenant_and_spare_the_others(start_server, tmp_path):
    path = tmp_path / "tenants"
    path.write_text(f"alice {TOKENS['alice']}\nbob {TOKENS['bob']}\n")
    path.chmod(0o600)
    server = start_server(tenants=str(path), tenant_shm_quota="1536K", tenant_snapshot_quota="1M")
    alice, bob = (SwapStateClient(ClientConfig(server.address, token=TOKENS[name], rpc_timeout_s=10.0))
                  for name in ("alice", "bob"))
    big = [("w", "float32", [384, 512])]  # 768 KiB: two pass a 1.5 MiB quota with their headers
    try:
        first = alice.attach("a1", 0, 1)
        first.allocate(big)
        second = alice.attach("a2", 0, 1)
        with pytest.raises(errors.BudgetExhaustedError, match="--tenant-shm-quota"):
            second.allocate(big)
        others = bob.attach("b1", 0, 1)
        others.allocate(big)  # Bob's quota is his own

        half = [("w", "float32", [256, 512])]  # 512 KiB: one snapshot fits a 1 MiB quota, two do not
        small = alice.attach("a3", 0, 1)
        first.close()  # room in the shm quota for it
        small.allocate(half)
        _snapshot(small, 1)
        small.commit(2)
        with pytest.raises(errors.BudgetExhaustedError, match="--tenant-snapshot-quota"):
            small.snapshot(2)
        theirs = bob.attach("b2", 0, 1)
        theirs.allocate(half)
        _snapshot(theirs, 1)  # Bob's snapshots are counted apart
    finally:
        alice.close()
        bob.close()


def test_other_hosts_see_the_owner_in_the_store(start_server, tmp_path):
    """Alice's job snapshotted on host A reaches the store with its tenant: on host B, which
    holds nothing of it, Bob can neither attach that job id, nor list or restore it."""
    path = tmp_path / "tenants"
    path.write_text(f"alice {TOKENS['alice']}\nbob {TOKENS['bob']}\n")
    path.chmod(0o600)
    store = str(tmp_path / "store")
    host_a, host_b = (start_server(tenants=str(path), snapshot_store=store, snapshot_dir=tmp_path / name)
                      for name in ("a-snapshots", "b-snapshots"))
    alice_a, alice_b, bob_b = (SwapStateClient(ClientConfig(host.address, token=TOKENS[who], rpc_timeout_s=10.0))
                               for host, who in ((host_a, "alice"), (host_b, "alice"), (host_b, "bob")))
    try:
        mine = alice_a.attach("shared", 0, 1)
        mine.allocate(SPECS)
        mine.commit(1)
        snapshot_id = mine.snapshot(1).snapshot_id
        stored = alice_a.snapshot_status(snapshot_id, 0, wait_s=30.0, wait_stored=True)
        assert stored.store_state == "stored", stored
        mine.close()

        _denied(bob_b.attach, "shared", 0, 1)  # host B learns the owner from the store
        assert [s.snapshot_id for s in bob_b.list_snapshots().snapshots] == []
        assert [s.snapshot_id for s in alice_b.list_snapshots().snapshots] == [snapshot_id]
        theirs = bob_b.attach("bobs", 0, 1)
        theirs.allocate(SPECS)
        _denied(theirs.restore, snapshot_id)  # read from the store: its markers name Alice
        theirs.close()
        again = alice_b.attach("shared", 0, 1)
        again.allocate(SPECS)
        assert again.restore(snapshot_id).source == "store"
        again.close()
    finally:
        for client in (alice_a, alice_b, bob_b):
            client.close()


def test_a_tenant_keeps_at_most_the_servers_keep_latest(server, clients):
    """A job may ask to keep every snapshot; on a server shared by tenants, a tenant that is
    not an admin keeps at most --keep-latest (2) of them, the newest."""
    session = clients["bob"].attach("hoarder", 0, 1)
    session.allocate(SPECS)
    for step in (1, 2, 3):
        session.commit(step)
        snapshot_id = session.snapshot(step, keep_all=True).snapshot_id
        assert session.client.snapshot_status(snapshot_id, 0, wait_s=30.0).state == "durable"
    listed = [s.step for s in clients["bob"].list_snapshots("hoarder").snapshots]
    assert listed == [2, 3]
    session.close()


def test_a_client_made_before_its_server_proves_its_uid_once_it_is_up(tmp_path, private_shm_dir):
    """A trainer that called before the server was up (refused: nothing listens) proves its
    uid once the server answers: its later calls are not refused as unproven."""
    sock = tmp_path / "s.sock"
    client = SwapStateClient(ClientConfig(f"unix://{sock}", rpc_timeout_s=5.0, connect_timeout_s=30.0,
                                          server_wait_s=0.0))
    log = (tmp_path / "server.log").open("w")
    proc = None
    try:
        with pytest.raises(errors.ServerUnavailableError):
            client.stats()
        proc = subprocess.Popen([sys.executable, "-m", "swap_state.server.cli", "--shm-size", "64M",
                                 "--listen", f"unix://{sock}", "--shm-dir", private_shm_dir],
                                stdout=subprocess.DEVNULL, stderr=log)
        # The socket may take longer than the client's short wait for it on a loaded machine.
        assert wait_until(lambda: sock.exists() or proc.poll() is not None, timeout_s=60) and proc.poll() is None
        client.wait_ready()
        assert client.stats().budget_total_bytes == 64 << 20
    finally:
        client.close()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        log.close()
