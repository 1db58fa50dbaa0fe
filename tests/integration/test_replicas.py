"""Snapshots replicated into a peer server's memory (``--replica-peers`` -> ``--replica-listen``):
two real server processes stand for two hosts, each with its own shm and snapshot directories,
the replica wire over loopback. What arrives is the sender's files byte for byte; a wrong
secret, a full peer, a peer that is down, a corrupt file and a hostile caller fail the replica
(or the caller), never the snapshot, and say why."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import ssl
import tempfile
import threading

import pytest

from swap_state.client.errors import SwapStateError
from swap_state.common.addresses import parse_address
from swap_state.common.checksum import crc32
from swap_state.common.retry import wait_until
from swap_state.common.snapshot_format import INDEX_NAME, FileRecord, rank_data_name, rank_manifest_name
from swap_state.server.snapshot.tiers.replica_wire import (DATA_FRAME_BYTES, PeerCredentials, ReplicaRefused, WireError,
                                                            connect_to_peer)

from .test_server_metrics import _free_port, _scrape
from snapshot_kit import params_copy, reference, swap_state_cli

from .certs import make_pair, write_pair
from .workload import Workload, build, mismatches, remote, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

W = Workload(seed=3)


@pytest.fixture
def hosts_shm():
    """A folder in /dev/shm for the hosts' shm directories, removed afterwards."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-replica-hosts-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _secret(tmp_path: pathlib.Path, name: str = "secret", text: str = "a-replica-secret-of-32-bytes-xyz") -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return str(path)


def _peer(start_server, hosts_shm, tmp_path, secret: str, size: str = "64M", **settings):
    """Host b: a server taking replicas; (server, its replica address, its shm directory)."""
    port, shm = _free_port(), hosts_shm / "b"
    shm.mkdir()
    server = start_server(snapshot_dir=tmp_path / "b-snapshots", shm_dir=str(shm), replica_listen=f"tcp://127.0.0.1:{port}",
                          replica_size=size, replica_secret_file=secret, **settings)
    return server, f"tcp://127.0.0.1:{port}", shm


def _sender(start_server, hosts_shm, tmp_path, peers: str, secret: str, **settings):
    shm = hosts_shm / "a"
    shm.mkdir()
    return start_server(snapshot_dir=tmp_path / "a-snapshots", shm_dir=str(shm), replica_peers=peers,
                        replica_secret_file=secret, **settings)


def _snapshot(server, job: str):
    model = build(W)
    container = remote(W, model, server.address, job)
    train(model, container, W, range(1, 4))
    return container, container.snapshot()


def _durable_not_replicated(server, job: str, why: str) -> None:
    """A snapshot of ``job`` at ``server`` is durable, and its replica failed saying ``why``."""
    container, handle = _snapshot(server, job)
    try:
        with pytest.raises(SwapStateError, match=why):
            handle.wait_replicated(timeout_s=60)
        assert handle.wait_durable(timeout_s=60).state == "durable"
    finally:
        container.close()


def _restore_latest(server, job: str) -> int:
    """A new trainer of ``job`` at ``server`` restores its latest snapshot; the step."""
    container = remote(W, build(W), server.address, job)
    try:
        return container.restore("latest")
    finally:
        container.close()


def test_a_snapshot_is_replicated_into_the_peers_memory_byte_for_byte(start_server, hosts_shm, tmp_path):
    """...and both servers' metrics count it."""
    secret, ports = _secret(tmp_path), (_free_port(), _free_port())
    _, address, peer_shm = _peer(start_server, hosts_shm, tmp_path, secret, metrics_port=f"127.0.0.1:{ports[0]}")
    sender = _sender(start_server, hosts_shm, tmp_path, address, secret, metrics_port=f"127.0.0.1:{ports[1]}")
    container, handle = _snapshot(sender, "replicated")
    try:
        reply = handle.wait_replicated(timeout_s=60)
        durable = handle.wait_durable(timeout_s=10)
    finally:
        container.close()
    assert reply.replica_state == "replicated" and address in reply.replica_peer, reply
    listed = swap_state_cli("snapshots", "--server", sender.address, "--job-id", "replicated")
    assert listed.returncode == 0 and f"replica replicated {address}" in listed.stdout, listed
    replicas = list(peer_shm.glob("swap-state-replicas-*/replicated/step-*"))
    assert [path.name for path in replicas] == [pathlib.Path(durable.path).name]
    local = pathlib.Path(durable.path)
    for name in (rank_data_name(0), INDEX_NAME):
        assert (replicas[0] / name).read_bytes() == (local / name).read_bytes(), name
    peer_metrics, sender_metrics = _scrape(ports[0]), _scrape(ports[1])
    nbytes = sender_metrics["swap_state_replica_sent_bytes_total"]
    assert sender_metrics["swap_state_replicas_sent_total"] == 1 and nbytes >= (local / rank_data_name(0)).stat().st_size
    assert sender_metrics["swap_state_replicas_failed_total"] == 0
    assert (peer_metrics["swap_state_replicas_received_total"], peer_metrics["swap_state_replica_received_bytes_total"]) \
        == (1, nbytes)
    assert nbytes <= peer_metrics["swap_state_replica_held_bytes"] <= peer_metrics["swap_state_replica_size_bytes"]
    assert peer_metrics["swap_state_replica_connections_refused_total"] == 0


def test_a_wrong_secret_fails_the_replica_not_the_snapshot(start_server, hosts_shm, tmp_path):
    """...counted on both sides."""
    ports = (_free_port(), _free_port())
    _, address, peer_shm = _peer(start_server, hosts_shm, tmp_path, _secret(tmp_path), metrics_port=f"127.0.0.1:{ports[0]}")
    sender = _sender(start_server, hosts_shm, tmp_path, address,
                     _secret(tmp_path, "other", "another-secret-of-at-least-16-bytes"),
                     metrics_port=f"127.0.0.1:{ports[1]}")
    _durable_not_replicated(sender, "wrong-secret", "does not hold this server's --replica-secret-file")
    assert not list(peer_shm.glob("swap-state-replicas-*/wrong-secret/step-*"))
    assert _scrape(ports[1])["swap_state_replicas_failed_total"] == 1
    assert wait_until(lambda: _scrape(ports[0])["swap_state_replica_connections_refused_total"] >= 1, timeout_s=10)
    assert _scrape(ports[0])["swap_state_replicas_received_total"] == 0


def test_a_full_peer_refuses_and_says_which_flag(start_server, hosts_shm, tmp_path):
    secret = _secret(tmp_path)
    _, address, _ = _peer(start_server, hosts_shm, tmp_path, secret, size="4K")
    sender = _sender(start_server, hosts_shm, tmp_path, address, secret)
    _durable_not_replicated(sender, "full", "raise --replica-size")


def test_a_peer_that_is_down_fails_the_replica_naming_it(start_server, hosts_shm, tmp_path):
    address = f"tcp://127.0.0.1:{_free_port()}"  # nothing listens there
    sender = _sender(start_server, hosts_shm, tmp_path, address, _secret(tmp_path))
    container, handle = _snapshot(sender, "down")
    try:
        with pytest.raises(SwapStateError, match=f"cannot reach replica peer {address}"):
            handle.wait_replicated(timeout_s=60)
    finally:
        container.close()


def _prepared_step(start_server, hosts_shm, tmp_path, job: str, nbytes: int):
    """A peer, and a connection to it that prepared step 1 of ``job`` as a sender does:
    (the connection, the peer's shm directory)."""
    secret = _secret(tmp_path)
    _, address, peer_shm = _peer(start_server, hosts_shm, tmp_path, secret)
    conn = connect_to_peer(parse_address(address), PeerCredentials(pathlib.Path(secret).read_text().strip().encode()))
    conn.request({"op": "prepare", "job_id": job, "step": 1, "world_size": 1, "tenant": "", "keep": None,
                  "replace": False, "bytes": nbytes})
    return conn, peer_shm


def test_a_file_that_arrives_unlike_its_checksum_is_refused_and_never_listed(start_server, hosts_shm, tmp_path):
    conn, peer_shm = _prepared_step(start_server, hosts_shm, tmp_path, "corrupt", 1 << 20)
    try:
        data = os.urandom(1 << 20)
        conn.send({"op": "open", "name": rank_data_name(0)})
        conn.send_data(data)
        conn.request({"op": "end", "bytes": len(data)})
        claimed = FileRecord(rank_data_name(0), 0, len(data), crc32(data) ^ 1)  # not the bytes that arrived
        with pytest.raises(ReplicaRefused, match="not here as its index lists it"):
            conn.request({"op": "finish_rank", "rank": 0, "files": [claimed.to_json()]})
        with pytest.raises(ReplicaRefused, match="the step failed"):
            conn.request({"op": "finish_rank", "rank": 0, "files": []})
    finally:
        conn.close()
    assert not list(peer_shm.glob("swap-state-replicas-*/corrupt/step-*"))


def test_a_caller_without_the_secret_gets_nothing_and_cannot_make_it_allocate(start_server, hosts_shm, tmp_path):
    secret = _secret(tmp_path)
    _, address, _ = _peer(start_server, hosts_shm, tmp_path, secret)
    peer = parse_address(address)
    with socket.create_connection((peer.host, peer.port), timeout=10) as sock:
        sock.sendall(b"SSR1\x01" + (DATA_FRAME_BYTES * 64).to_bytes(8, "big"))  # a 512 MiB "hello"
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed, nothing read or allocated
    with pytest.raises(ReplicaRefused, match="does not hold"):
        connect_to_peer(peer, PeerCredentials(b"not-the-secret-but-long-enough"))
    connect_to_peer(peer, PeerCredentials(pathlib.Path(secret).read_text().strip().encode())).close()  # still serving


@pytest.mark.parametrize("where", ["beside_the_peer", "on_a_replacement_host"])
def test_a_lost_hosts_ranks_resume_from_the_replica_in_the_other_hosts_memory(where, start_server, hosts_shm,
                                                                              tmp_path):
    """Two hosts replicating into each other, no store, a snapshot on disk at step 2 and a
    memory-only one every 5 steps (``replica_interval``): host a is lost with its memory and disks
    at step 6, its ranks restart beside host b's (and read b's memory), or on a new host c whose
    --replica-peers names b (and read b's memory over the replica wire), and restore step 5, the
    newest replicated, bitwise as if uninterrupted: the loss costs the step since."""
    secret, ports = _secret(tmp_path), {"a": _free_port(), "b": _free_port()}
    hosts, work = {"a": (0, 1), "b": (2, 3)}, {rank: Workload(seed=rank) for rank in range(4)}
    servers = {}
    for host, other in (("a", "b"), ("b", "a")):
        (hosts_shm / host).mkdir()
        servers[host] = start_server(snapshot_dir=tmp_path / f"{host}-snapshots", shm_dir=str(hosts_shm / host),
                                     replica_listen=f"tcp://127.0.0.1:{ports[host]}", replica_size="64M",
                                     replica_peers=f"tcp://127.0.0.1:{ports[other]}", replica_secret_file=secret)
    models = {rank: build(work[rank]) for rank in range(4)}
    containers = {rank: remote(work[rank], models[rank], servers[host].address, "lost", rank=rank, world_size=4,
                               local_world_size=2, replica_interval=5) for host, ranks in hosts.items() for rank in ranks}
    try:
        for rank in range(4):
            train(models[rank], containers[rank], work[rank], range(1, 3))
        for handle in [containers[rank].snapshot() for rank in range(4)]:  # on disk, and replicated
            assert handle.wait_replicated(timeout_s=60).replica_state == "replicated"
        params_at_5 = {}
        for rank in range(4):
            train(models[rank], containers[rank], work[rank], range(3, 6))
            params_at_5[rank] = params_copy(models[rank])
            train(models[rank], containers[rank], work[rank], range(6, 7))  # snapshots step 5 as it begins
        for rank in range(4):
            handle = containers[rank].segment.snapshot_handle
            assert handle.step == 5 and handle.wait_replicated(timeout_s=60).replica_state == "replicated"
        assert not list((tmp_path / "b-snapshots").glob("lost/step-*5")), "memory-only, yet on disk"
        for rank in hosts["a"]:
            containers.pop(rank).close()
        servers["a"].stop()  # host a is lost, its memory and disks with it
        shutil.rmtree(tmp_path / "a-snapshots")
        shutil.rmtree(hosts_shm / "a")
        new_host = servers["b"]
        if where == "on_a_replacement_host":
            (hosts_shm / "c").mkdir()
            new_host = start_server(snapshot_dir=tmp_path / "c-snapshots", shm_dir=str(hosts_shm / "c"),
                                    replica_peers=f"tcp://127.0.0.1:{ports['b']}", replica_secret_file=secret)
        for rank in hosts["a"]:
            models[rank] = build(work[rank])
            containers[rank] = remote(work[rank], models[rank], new_host.address, "lost", rank=rank,
                                      world_size=4, local_world_size=2)
        for rank in range(4):
            if rank in hosts["b"]:
                train(models[rank], containers[rank], work[rank], range(6, 8))  # diverge, then go back
            assert containers[rank].restore("latest") == 5
            models[rank].load_state_dict(params_at_5[rank])
            train(models[rank], containers[rank], work[rank], range(6, 11))
            ref_model, ref_opt = reference(work[rank], build, 10)
            assert mismatches(models[rank], containers[rank], ref_model, ref_opt) == [], rank
        assembled = [line for line in new_host.log_text().splitlines() if "event=restore_assembled" in line]
        replicas_of_a = "swap-state-replicas-" if where != "on_a_replacement_host" else f"127.0.0.1:{ports['b']}/"
        assert assembled and all(replicas_of_a in line.split("read_from=")[1] for line in assembled
                                 if " rank=0 " in line), assembled  # a's rank 0: b's replicas, here or over the wire
    finally:
        for container in containers.values():
            container.close()


def test_a_flipped_byte_in_a_replica_is_never_loaded(start_server, hosts_shm, tmp_path):
    secret = _secret(tmp_path)
    peer, address, peer_shm = _peer(start_server, hosts_shm, tmp_path, secret)
    sender = _sender(start_server, hosts_shm, tmp_path, address, secret)
    container, handle = _snapshot(sender, "rot")
    try:
        handle.wait_replicated(timeout_s=60)
    finally:
        container.close()
    [data] = peer_shm.glob(f"swap-state-replicas-*/rot/step-*/{rank_data_name(0)}")
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x40  # inside the last tensor
    data.write_bytes(bytes(raw))
    with pytest.raises(SwapStateError, match=f"{rank_data_name(0)}.*fails its checksum"):
        _restore_latest(peer, "rot")


def test_a_peer_killed_mid_replica_fails_the_replica_not_the_snapshot(start_server, hosts_shm, tmp_path):
    secret = _secret(tmp_path)
    peer, address, peer_shm = _peer(start_server, hosts_shm, tmp_path, secret)
    # 1 KiB/s: the first snapshot's bytes take the cap's next seconds, so the second waits in
    # mid-replica (prepared on the peer, its data held back) while the peer is killed.
    sender = _sender(start_server, hosts_shm, tmp_path, address, secret, replica_max_bandwidth="1K")
    model = build(W)
    container = remote(W, model, sender.address, "killed")
    try:
        train(model, container, W, range(1, 3))
        container.snapshot().wait_replicated(timeout_s=60)
        train(model, container, W, range(3, 4))
        handle = container.snapshot()
        assert wait_until(lambda: list(peer_shm.glob("swap-state-replicas-*/killed/.partial-*")), timeout_s=60)
        peer.kill()
        with pytest.raises(SwapStateError, match="not replicated: replicating killed/step-3"):
            handle.wait_replicated(timeout_s=120)
        assert handle.wait_durable(timeout_s=10).state == "durable"
    finally:
        container.close()


def test_a_restarted_peer_keeps_its_replicas_and_restores_from_them(start_server, hosts_shm, tmp_path):
    secret = _secret(tmp_path)
    peer, address, _ = _peer(start_server, hosts_shm, tmp_path, secret)
    sender = _sender(start_server, hosts_shm, tmp_path, address, secret)
    container, handle = _snapshot(sender, "kept")
    try:
        handle.wait_replicated(timeout_s=60)
    finally:
        container.close()
    peer.restart()  # on the same address: the replicas are files under its --shm-dir, named after it
    listed = swap_state_cli("snapshots", "--server", peer.address, "--job-id", "kept")
    assert listed.returncode == 0 and "kept/step-3" in listed.stdout, listed
    assert _restore_latest(peer, "kept") == 3


def _replicated_and_stored(start_server, hosts_shm, tmp_path, job: str):
    """Host a's snapshot of ``job``, replicated into host b and stored: (a, b, b's shm directory,
    a function starting a new host c whose --replica-peers name b, with the store)."""
    secret, store = _secret(tmp_path), str(tmp_path / "store")
    peer, address, peer_shm = _peer(start_server, hosts_shm, tmp_path, secret)
    sender = _sender(start_server, hosts_shm, tmp_path, address, secret, snapshot_store=store)
    container, handle = _snapshot(sender, job)
    try:
        handle.wait_replicated(timeout_s=60)
        handle.wait_stored(timeout_s=60)
    finally:
        container.close()

    def new_host():
        (hosts_shm / "c").mkdir()
        return start_server(snapshot_dir=tmp_path / "c-snapshots", shm_dir=str(hosts_shm / "c"),
                            replica_peers=address, replica_secret_file=secret, snapshot_store=store)

    return sender, peer, peer_shm, new_host


def test_both_hosts_lost_the_job_resumes_from_the_store(start_server, hosts_shm, tmp_path):
    """Replicas and the store together: when the host and its peer are both lost, a new host
    (its --replica-peers naming the lost peer) passes over the peer and restores from the store."""
    sender, peer, peer_shm, new_host = _replicated_and_stored(start_server, hosts_shm, tmp_path, "both")
    for lost in (sender, peer):
        lost.kill()
    shutil.rmtree(peer_shm)
    host_c = new_host()
    assert _restore_latest(host_c, "both") == 3
    log = host_c.log_text()
    assert "source=store" in log and "replica_peer_unreadable" in log, log[-3000:]


def test_a_malformed_message_from_a_peer_is_refused_and_the_peer_keeps_serving(start_server, hosts_shm, tmp_path):
    conn, _ = _prepared_step(start_server, hosts_shm, tmp_path, "malformed", 0)
    try:
        with pytest.raises(ReplicaRefused, match="malformed 'finish_rank'"):
            conn.request({"op": "finish_rank", "rank": 0, "files": [{"name": 7}]})
        with pytest.raises(ReplicaRefused, match="not a rank file"):
            conn.request({"op": "write", "name": "../../etc/passwd"}, b"x")
        conn.request({"op": "write", "name": rank_manifest_name(0)}, b"{}")  # the connection still in step
    finally:
        conn.close()


def test_a_memory_only_snapshot_without_replica_peers_is_refused_naming_the_flag(start_server, tmp_path):
    server = start_server(snapshot_dir=tmp_path / "snapshots")
    model = build(W)
    container = remote(W, model, server.address, "no-peers")
    try:
        train(model, container, W, range(1, 3))
        with pytest.raises(SwapStateError, match="no --replica-peers") as refused:
            container.snapshot(memory_only=True)
        assert refused.value.reason == "REPLICA_PEERS_UNSET"
        assert container.snapshot().wait_durable(timeout_s=60).state == "durable"  # nothing was left behind
    finally:
        container.close()


def test_a_flipped_byte_in_a_replica_falls_back_to_the_stores_copy_of_the_step(start_server, hosts_shm, tmp_path):
    """Host a is lost; its replica in b's memory rotted: a new host c reads b's replica over the
    wire, finds the bad crc32 before anything is kept, and restores the same step from the store."""
    sender, _, peer_shm, new_host = _replicated_and_stored(start_server, hosts_shm, tmp_path, "rot-stored")
    sender.kill()
    [data] = peer_shm.glob(f"swap-state-replicas-*/rot-stored/step-*/{rank_data_name(0)}")
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x40
    data.write_bytes(bytes(raw))
    host_c = new_host()
    assert _restore_latest(host_c, "rot-stored") == 3
    log = host_c.log_text()
    assert "event=restore_fallback" in log and "fails its checksum" in log and "source=store" in log, log[-3000:]


def test_memory_only_snapshots_in_a_row_are_written_over_the_pages_of_those_removed(start_server, hosts_shm,
                                                                                     tmp_path):
    """A fresh tmpfs page costs its allocation and zeroing (docs/benchmarks.md): each host keeps
    the data file of the step its retention removed and writes the next step over it; the
    replica stays the sender's bytes, and restores."""
    secret = _secret(tmp_path)
    _, address, peer_shm = _peer(start_server, hosts_shm, tmp_path, secret)
    sender = _sender(start_server, hosts_shm, tmp_path, address, secret)
    model = build(W)
    container = remote(W, model, sender.address, "reused")
    inodes: dict[str, set[int]] = {"memory": set(), "replicas": set()}
    try:
        for step in range(1, 6):
            train(model, container, W, range(step, step + 1))
            assert container.snapshot(memory_only=True).wait_replicated(timeout_s=60).replica_state == "replicated"
            files = {kind: list(shm.glob(f"swap-state-{kind}-*/reused/step-*/{rank_data_name(0)}"))
                     for kind, shm in (("memory", hosts_shm / "a"), ("replicas", peer_shm))}
            assert [len(found) for found in files.values()] == [1, 1], files  # the newest step only
            assert files["memory"][0].read_bytes() == files["replicas"][0].read_bytes()
            for kind, (found,) in files.items():
                inodes[kind].add(found.stat().st_ino)
    finally:
        container.close()
    assert [len(seen) for seen in inodes.values()] == [2, 2], inodes  # two files, written over in turn
    assert _restore_latest(sender, "reused") == 5


def test_peers_proving_themselves_by_mutual_tls_alone_replicate_and_refuse_a_stranger(start_server, hosts_shm,
                                                                                       tmp_path):
    """``--replica-tls-*`` instead of a shared secret: a snapshot is replicated over TLS byte for
    byte and a new host restores it from the peer's memory; a server whose certificate another CA
    signed is refused by the peer (logged there), its own snapshot durable all the same."""
    pytest.importorskip("cryptography.x509", reason="needs cryptography (the dev extra)")
    ca, other_ca = make_pair("replica peers' CA"), make_pair("someone else's CA")
    roots = write_pair(tmp_path, "ca", ca)[0]

    def host(name: str, issuer=ca, **settings):
        (hosts_shm / name).mkdir()
        cert, key = write_pair(tmp_path, name, make_pair(f"host {name}", issuer, server=True))
        return start_server(snapshot_dir=tmp_path / f"{name}-snapshots", shm_dir=str(hosts_shm / name),
                            replica_tls_cert=cert, replica_tls_key=key, replica_tls_ca=roots, **settings)

    address = f"tcp://127.0.0.1:{_free_port()}"
    peer = host("b", replica_listen=address, replica_size="64M")
    container, handle = _snapshot(host("a", replica_peers=address), "over-tls")
    try:
        assert handle.wait_replicated(timeout_s=60).replica_state == "replicated"
        durable = pathlib.Path(handle.wait_durable(timeout_s=10).path)
    finally:
        container.close()
    [replica] = (hosts_shm / "b").glob("swap-state-replicas-*/over-tls/step-*")
    assert (replica / rank_data_name(0)).read_bytes() == (durable / rank_data_name(0)).read_bytes()
    assert _restore_latest(host("c", replica_peers=address), "over-tls") == 3  # a's disk is not c's

    _durable_not_replicated(host("s", issuer=other_ca, replica_peers=address), "stranger", "mutual TLS failed")
    assert wait_until(lambda: "event=replica_connection_refused" in peer.log_text(), timeout_s=10)
    assert not list((hosts_shm / "b").glob("swap-state-replicas-*/stranger"))


def test_a_tls_peer_that_hangs_up_before_its_first_answer_is_named_as_a_certificate_refusal(tmp_path):
    """Over TLS 1.3 a peer refuses the sender's certificate after the handshake, and its close can
    reach the sender before its alert (one CI run in four, beside other tests): the sender's error
    names the ``--replica-tls-*`` flags all the same. Here the peer closes without a word."""
    pytest.importorskip("cryptography.x509", reason="needs cryptography (the dev extra)")
    ca = make_pair("replica peers' CA")
    roots = write_pair(tmp_path, "ca", ca)[0]
    accepting, connecting = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    accepting.load_cert_chain(*write_pair(tmp_path, "peer", make_pair("host b", ca, server=True)))
    connecting.load_verify_locations(roots)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def hang_up() -> None:
            sock, _ = listener.accept()
            accepting.wrap_socket(sock, server_side=True).close()  # the handshake, then no alert, no answer

        peer = threading.Thread(target=hang_up, daemon=True)
        peer.start()
        address = parse_address(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
        with pytest.raises(WireError, match="mutual TLS failed") as refused:
            connect_to_peer(address, PeerCredentials(None, connecting, accepting), timeout_s=10)
        peer.join(timeout=10)
    assert "--replica-tls-*" in str(refused.value)
