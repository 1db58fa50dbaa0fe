"""The trainer finds the host's server: with no address configured it uses the server that
answers at the default socket, and only without one starts a private server (a job of several
ranks says so at WARNING, naming the setting)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from swap_state.client.remote.config import host_server
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient, SwapStateError
from swap_state.common.addresses import default_socket_path
from swap_state.common.retry import wait_until

from .workload import Workload, build, remote, train

pytestmark = pytest.mark.integration


@pytest.fixture
def host_server_process(no_server_env, private_shm_dir, tmp_path):
    """A real server started as an operator would, with no --listen: the default socket
    (under this test's empty $XDG_RUNTIME_DIR)."""
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swap_state.server", "--shm-size", "128M", "--shm-dir", private_shm_dir,
         "--snapshot-dir", str(tmp_path / "snapshots")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        assert wait_until(lambda: host_server() is not None or proc.poll() is not None, timeout_s=30)
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        yield proc
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_a_trainer_with_no_address_uses_the_hosts_server_at_the_default_socket(host_server_process, caplog):
    w = Workload()
    model = build(w)
    with caplog.at_level(logging.INFO, logger="swap_state.client"):
        container = remote(w, model, None, "found-by-default")
    sizing = [r.getMessage() for r in caplog.records if "swap-state segment of job found-by-default" in r.getMessage()]
    assert len(sizing) == 1 and "parameters: moments" in sizing[0] and "--shm-size" in sizing[0], sizing
    try:
        assert container.remote_config.server == f"unix://{default_socket_path()}"
        assert container.segment.embedded is None  # no private server
        train(model, container, w, range(1, 3))
        [session] = container.client.stats().sessions
        assert (session.job_id, session.state, session.steps_committed) == ("found-by-default", "live", 2)
    finally:
        container.close()


def test_without_a_hosts_server_a_multi_rank_job_warns_once_and_starts_private_servers(no_server_env, caplog):
    stale = default_socket_path()
    stale.parent.mkdir(parents=True)
    stale.write_text("")  # not a socket: nothing answers there
    w = Workload()
    model = build(w)
    with caplog.at_level(logging.WARNING, logger="swap_state.client"):
        rank0 = remote(w, model, None, "private", rank=0, world_size=2)
        rank1 = remote(w, build(w), None, "private", rank=1, world_size=2)
    try:
        assert rank0.segment.embedded is not None and rank1.segment.embedded is not None
        warnings = [r.getMessage() for r in caplog.records if "starts a private server" in r.getMessage()]
        assert len(warnings) == 1, warnings  # rank 0's, once
        assert "$SWAP_STATE_SERVER" in warnings[0] and str(stale) in warnings[0]
    finally:
        rank0.close()
        rank1.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give the server's socket to another uid)")
def test_a_socket_of_another_user_is_refused_before_anything_is_sent(start_server):
    server = start_server()
    socket_path = server.address.removeprefix("unix://")
    os.chown(socket_path, 54321, -1)  # as if another user had taken the path first
    w = Workload()
    with pytest.raises(SwapStateError, match=r"belongs to uid 54321.*SWAP_STATE_SERVER_UID=54321"):
        remote(w, build(w), server.address, "foreign")
    stats = SwapStateClient(ClientConfig(server.address, server_uid=54321))
    try:
        assert [s.job_id for s in stats.stats().sessions] == []  # the refused trainer never attached
    finally:
        stats.close()
    trusted = remote(w, build(w), server.address, "told", server_uid=54321)  # told to expect that owner
    trusted.close()


def test_a_socket_path_with_nothing_there_fails_at_once_naming_it(tmp_path):
    import time

    from swap_state.client.errors import ServerUnavailableError

    address = f"unix://{tmp_path}/wrong/swap-state.sock"
    client = SwapStateClient(ClientConfig(address, connect_timeout_s=30))
    began = time.monotonic()
    try:
        with pytest.raises(ServerUnavailableError, match=r"no socket file .*wrong/swap-state.sock.*Is the server running"):
            client.wait_ready()
    finally:
        client.close()
    assert time.monotonic() - began < 5  # not the 30 s connect timeout
