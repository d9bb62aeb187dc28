"""``moe-cluster node-cert``: a node's certificate issued from the cluster's CA
(what each pod's init container runs under ``kubernetes.tls.issuer:
ca_secret``), and the mutual TLS that Ray's variables naming it then give
moe-cluster's sockets (``cluster.tls``)."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    NoEncryption,
    PrivateFormat,
)

from cluster import tls
from deployments.cli import main
from tests.tls_certs import make_ca, write_ca, write_certs


def issue(ca_dir: Path, out: Path, *names: str) -> int:
    return main(["node-cert", "--ca-dir", str(ca_dir), "--out-dir", str(out), *names])


def node_env(folder: Path) -> dict[str, str]:
    return {
        tls.FLAG: "1",
        tls.CERT: str(folder / "tls.crt"),
        tls.KEY: str(folder / "tls.key"),
        tls.CA: str(folder / "ca.crt"),
    }


def handshake(
    monkeypatch: pytest.MonkeyPatch, server: dict[str, str], client: dict[str, str]
) -> str | None:
    """A TLS connection to 127.0.0.1 between a server and a client that each
    run with the given Ray TLS variables; None where both ends accept it, else
    the error either end saw."""
    for var, value in server.items():
        monkeypatch.setenv(var, value)
    server_ctx = tls.server_context()
    for var, value in client.items():
        monkeypatch.setenv(var, value)
    client_ctx = tls.client_context()
    assert server_ctx is not None and client_ctx is not None
    errors: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as s:
                    s.sendall(b"ok")
            except (ssl.SSLError, OSError) as e:
                errors.append(f"server: {e}")

        t = threading.Thread(target=serve)
        t.start()
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
            ):
                if s.recv(2) != b"ok":
                    errors.append("client: no answer")
        except (ssl.SSLError, OSError) as e:
            errors.append(f"client: {e}")
        t.join(10)
    return "; ".join(errors) or None


@pytest.mark.parametrize("key_kind", ["ec", "rsa"])
def test_a_node_certificate_from_the_ca_serves_mutual_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key_kind: str
) -> None:
    ca_dir = write_ca(tmp_path / "ca", key_kind=key_kind)
    args = ["--ip", "127.0.0.1", "--dns", "localhost", "--dns", "*.ns.svc"]
    assert issue(ca_dir, tmp_path / "a", *args, "--days", "30") == 0
    assert issue(ca_dir, tmp_path / "b", *args) == 0
    key = tmp_path / "a" / "tls.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert (tmp_path / "a" / "ca.crt").read_bytes() == (ca_dir / "ca.crt").read_bytes()
    cert = x509.load_pem_x509_certificate((tmp_path / "a" / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1")
    ]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "*.ns.svc"]
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert 30 * 86400 <= lifetime.total_seconds() <= 30 * 86400 + 600
    # Two nodes with certificates from the one CA: each end accepts the other.
    a, b = node_env(tmp_path / "a"), node_env(tmp_path / "b")
    assert handshake(monkeypatch, a, b) is None
    # A node whose certificate another CA signed is refused, either way round.
    other = write_certs(tmp_path / "other", ca_name="another-ca")
    assert handshake(monkeypatch, a, other) is not None
    assert handshake(monkeypatch, other, b) is not None


def test_a_certificate_for_another_address_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_dir = write_ca(tmp_path / "ca")
    assert issue(ca_dir, tmp_path / "server", "--ip", "10.0.0.7") == 0
    assert issue(ca_dir, tmp_path / "client", "--ip", "127.0.0.1") == 0
    # The client dials 127.0.0.1; the server's certificate names 10.0.0.7 only.
    refused = handshake(
        monkeypatch, node_env(tmp_path / "server"), node_env(tmp_path / "client")
    )
    assert refused is not None and "client" in refused


def test_node_cert_refuses_what_would_not_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca_dir = write_ca(tmp_path / "ca")
    out = tmp_path / "out"
    assert issue(ca_dir, out) == 1  # no address at all
    assert "at least one IP or DNS name" in capsys.readouterr().err
    assert issue(ca_dir, out, "--ip", "not-an-ip") == 1
    assert "not-an-ip" in capsys.readouterr().err
    assert issue(ca_dir, out, "--ip", "127.0.0.1", "--days", "0") == 2
    assert "--days" in capsys.readouterr().err
    assert issue(tmp_path / "missing", out, "--ip", "127.0.0.1") == 1
    assert "ca.crt" in capsys.readouterr().err
    # A key that is not the CA's.
    other = write_ca(tmp_path / "other")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "ca.crt").write_bytes((ca_dir / "ca.crt").read_bytes())
    (tmp_path / "mixed" / "ca.key").write_bytes((other / "ca.key").read_bytes())
    assert issue(tmp_path / "mixed", out, "--ip", "127.0.0.1") == 1
    assert "is not the key of" in capsys.readouterr().err
    # A CA key under a passphrase (the init container has none to give).
    ca, ca_key = make_ca()
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "ca.crt").write_bytes(ca.public_bytes(Encoding.PEM))
    (tmp_path / "locked" / "ca.key").write_bytes(
        ca_key.private_bytes(
            Encoding.PEM,
            PrivateFormat.PKCS8,
            BestAvailableEncryption(b"passphrase"),
        )
    )
    assert issue(tmp_path / "locked", out, "--ip", "127.0.0.1") == 1
    assert "encrypted" in capsys.readouterr().err
    # A key that does not sign (key agreement only).
    (tmp_path / "x25519").mkdir()
    (tmp_path / "x25519" / "ca.crt").write_bytes(ca.public_bytes(Encoding.PEM))
    (tmp_path / "x25519" / "ca.key").write_bytes(
        x25519.X25519PrivateKey.generate().private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
        )
    )
    assert issue(tmp_path / "x25519", out, "--ip", "127.0.0.1") == 1
    assert "its key is X25519; a CA signs with" in capsys.readouterr().err
    # A node's certificate in the CA's place.
    assert issue(ca_dir, tmp_path / "node", "--ip", "127.0.0.1") == 0
    (tmp_path / "node" / "ca.crt").write_bytes(
        (tmp_path / "node" / "tls.crt").read_bytes()
    )
    (tmp_path / "node" / "ca.key").write_bytes(
        (tmp_path / "node" / "tls.key").read_bytes()
    )
    assert issue(tmp_path / "node", out, "--ip", "127.0.0.1") == 1
    assert "is not a CA certificate" in capsys.readouterr().err
    assert not out.exists()
