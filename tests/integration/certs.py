"""Certificates for the TLS tests (``--tls-*`` and ``--replica-tls-*``), made with
``cryptography`` (the dev extra; the tests importorskip it first)."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib


def make_pair(subject: str, issuer=None, server: bool = False):
    """(certificate PEM, key, name, key PEM) for ``subject``, signed by ``issuer`` (another
    pair; None: self-signed, a CA); ``server``: it names 127.0.0.1."""
    from cryptography import x509
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


def write_pair(folder: pathlib.Path, name: str, pair) -> tuple[str, str]:
    """``pair`` as ``folder/name.pem`` and ``folder/name.key`` (mode 0600); their paths."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    cert.write_bytes(pair[0])
    key.write_bytes(pair[3])
    key.chmod(0o600)
    return str(cert), str(key)
