"""A cluster's TLS files as Ray reads them (``cluster.tls``): a CA, and a node
certificate it signed for 127.0.0.1 and localhost, written under a folder; or a
CA's certificate and key alone, as ``moe-cluster node-cert`` reads them."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from cluster import tls


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(
    ca_name: str = "moe-test-ca", key_kind: str = "ec"
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey]:
    """A self-signed CA and its key (``key_kind``: ec or rsa)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey = (
        rsa.generate_private_key(65537, 2048)
        if key_kind == "rsa"
        else ec.generate_private_key(ec.SECP256R1())
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return ca, ca_key


def write_ca(folder: Path, ca_name: str = "moe-test-ca", key_kind: str = "ec") -> Path:
    """A CA's ``ca.crt`` and ``ca.key`` in ``folder``, as a Kubernetes Secret
    volume holding them shows them (``moe-cluster node-cert --ca-dir``)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = make_ca(ca_name, key_kind)
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "ca.key").write_bytes(_key_pem(ca_key))
    return folder


def write_certs(folder: Path, ca_name: str = "moe-test-ca") -> dict[str, str]:
    """Writes a CA's certificate and a node's certificate chain and key into
    ``folder``; Ray's TLS variables naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca, ca_key = make_ca(ca_name)
    key = ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
    ]
    node = (
        x509.CertificateBuilder()
        .subject_name(_name("moe-test-node"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = {
        tls.CERT: node.public_bytes(serialization.Encoding.PEM),
        tls.KEY: _key_pem(key),
        tls.CA: ca.public_bytes(serialization.Encoding.PEM),
    }
    env = {tls.FLAG: "1"}
    for var, pem in files.items():
        path = folder / f"{var.lower()}.pem"
        path.write_bytes(pem)
        env[var] = str(path)
    return env


def use_tls(monkeypatch: pytest.MonkeyPatch, folder: Path) -> dict[str, str]:
    """This process runs as a node of a cluster with Ray's TLS on."""
    env = write_certs(folder)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return env
