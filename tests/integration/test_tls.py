"""TLS on a tcp:// server, mutual with --tls-client-ca: a trainer with the roots and its client
certificate attaches and trains; one without a certificate, or with one no root signed, is
refused; the CLI takes the same files. Certificates made here with ``cryptography``."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import subprocess
import sys

import pytest

from swap_state.client.errors import ServerUnavailableError
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from swap_state.common.retry import wait_until

from .workload import Workload, build, remote, train

pytestmark = pytest.mark.integration
x509 = pytest.importorskip("cryptography.x509", reason="needs cryptography (the dev extra)")


def _pair(subject: str, issuer=None, server: bool = False):
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = (issuer[2], issuer[1]) if issuer else (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                        critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key, name, pem_key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mtls(tmp_path, private_shm_dir):
    files = {}
    ca = _pair("swap-state test CA")
    other_ca = _pair("someone else's CA")
    for name, pair in {"ca": ca, "server": _pair("server", ca, server=True), "client": _pair("trainer", ca),
                       "stranger": _pair("stranger", other_ca)}.items():
        (tmp_path / f"{name}.pem").write_bytes(pair[0])
        (tmp_path / f"{name}.key").write_bytes(pair[3])
        files[name] = (str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"))
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
