"""TLS on a tcp:// server, mutual with --tls-client-ca: a trainer with the roots and its client
certificate attaches and trains; one without a certificate, or with one no root signed, is
refused; the CLI takes the same files. Certificates made here with ``cryptography``."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from swap_state.client.errors import ServerUnavailableError
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from swap_state.common.retry import wait_until

from .certs import make_pair, write_pair
from .workload import Workload, build, remote, train

pytestmark = pytest.mark.integration
x509 = pytest.importorskip("cryptography.x509", reason="needs cryptography (the dev extra)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mtls(tmp_path, private_shm_dir):
    files = {}
    ca = make_pair("swap-state test CA")
    other_ca = make_pair("someone else's CA")
    for name, pair in {"ca": ca, "server": make_pair("server", ca, server=True), "client": make_pair("trainer", ca),
                       "stranger": make_pair("stranger", other_ca)}.items():
        files[name] = write_pair(tmp_path, name, pair)
    address = f"tcp://127.0.0.1:{_free_port()}"
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swap_state.server", "--shm-size", "128M", "--shm-dir", private_shm_dir,
         "--listen", address, "--tls-cert", files["server"][0], "--tls-key", files["server"][1],
         "--tls-client-ca", files["ca"][0]],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def serving() -> bool:
        client = SwapStateClient(ClientConfig(address, tls_root_cert=files["ca"][0], tls_client_cert=files["client"][0],
                                              tls_client_key=files["client"][1]))
        try:
            client.stats()
            return True
        except ServerUnavailableError:
            return proc.poll() is not None
        finally:
            client.close()

    try:
        assert wait_until(serving, timeout_s=30) and proc.poll() is None, (tmp_path / "server.log").read_text()
        yield address, files
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_mutual_tls_admits_the_trainer_with_a_signed_certificate_only(mtls, tmp_path):
    address, files = mtls
    w = Workload()
    model = build(w)
    container = remote(w, model, address, "mtls", tls_root_cert=files["ca"][0],
                       tls_client_cert=files["client"][0], tls_client_key=files["client"][1])
    try:
        train(model, container, w, range(1, 3))
        assert container.session.last_committed_step == 2
    finally:
        container.close()
    for cert, key in ((None, None), files["stranger"]):  # no certificate; one no root of the server's signed
        with pytest.raises(ServerUnavailableError):
            remote(w, build(w), address, "refused", tls_root_cert=files["ca"][0], tls_client_cert=cert,
                   tls_client_key=key, connect_timeout_s=3.0)
    status = subprocess.run(
        [sys.executable, "-m", "swap_state.client.cli", "status", "--server", address,
         "--tls-root-cert", files["ca"][0], "--tls-client-cert", files["client"][0],
         "--tls-client-key", files["client"][1]], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
