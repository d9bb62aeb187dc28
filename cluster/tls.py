"""Ray's TLS settings, for the sockets moe-cluster opens between nodes.

A Ray cluster runs with TLS where ``RAY_USE_TLS`` is set, with
``RAY_TLS_SERVER_CERT`` (the node's certificate chain), ``RAY_TLS_SERVER_KEY``
(its private key) and ``RAY_TLS_CA_CERT`` (the CA that signed every node's):
Ray's own gRPC servers then listen with them and require the caller's
certificate, and its channels connect with them. The engine replicas' direct
streams (``deployments.direct``) and the router's admission socket
(``router.wire``) do the same, so a cluster that Ray encrypts has no plaintext
hop of moe-cluster's own. Without ``RAY_USE_TLS`` they are plaintext, as Ray's
own traffic then is, and each still refuses a caller without its token.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

FLAG = "RAY_USE_TLS"
CERT, KEY, CA = "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"


def enabled() -> bool:
    """Whether this process's cluster runs with Ray's TLS."""
    return os.environ.get(FLAG, "0").lower() in ("1", "true")


def paths() -> tuple[str, str, str] | None:
    """The certificate chain's, the key's and the CA's files where TLS is on;
    None where it is off. Raises where it is on and one is not named."""
    if not enabled():
        return None
    if missing := [v for v in (CERT, KEY, CA) if not os.environ.get(v)]:
        raise RuntimeError(f"{FLAG} is set, but {', '.join(missing)} is not")
    return os.environ[CERT], os.environ[KEY], os.environ[CA]


def files() -> tuple[bytes, bytes, bytes] | None:
    """The certificate chain, the key and the CA's certificate, read (gRPC takes
    them as bytes); None where TLS is off."""
    if (where := paths()) is None:
        return None
    chain, key, ca = (Path(p).read_bytes() for p in where)
    return chain, key, ca


def server_context() -> ssl.SSLContext | None:
    """For a server socket: this node's certificate, and callers must present
    one the CA signed. None where TLS is off."""
    if (where := paths()) is None:
        return None
    chain, key, ca = where
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    context.load_cert_chain(chain, key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context() -> ssl.SSLContext | None:
    """For a client socket: the server's certificate checked against the CA (and
    the address it is reached at), this node's presented. None where TLS is
    off."""
    if (where := paths()) is None:
        return None
    chain, key, ca = where
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    context.load_cert_chain(chain, key)
    return context


def issue_node_files(
    ca_dir: Path,
    out_dir: Path,
    ips: list[str],
    dns_names: list[str],
    days: int = 365,
) -> tuple[Path, Path, Path]:
    """Issues this node's certificate from the CA in ``ca_dir`` (``ca.crt`` and
    ``ca.key``, PEM) for ``ips`` and ``dns_names``, good for client and server
    use, and writes ``tls.crt``, ``tls.key`` (mode 0600) and ``ca.crt`` into
    ``out_dir``: the files Ray's TLS variables name. What a pod's init container
    runs (``moe-cluster node-cert``) where the cluster's CA is a Secret."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not ips and not dns_names:
        raise ValueError("give the node's addresses: at least one IP or DNS name")
    ca_pem = (ca_dir / "ca.crt").read_bytes()
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(
        (ca_dir / "ca.key").read_bytes(), password=None
    )
    # DSA signs too, but is deprecated and not what TLS peers verify.
    signers = (
        rsa.RSAPrivateKey,
        ec.EllipticCurvePrivateKey,
        ed25519.Ed25519PrivateKey,
        ed448.Ed448PrivateKey,
    )
    if not isinstance(ca_key, signers):
        kind = type(ca_key).__name__.removesuffix("PrivateKey")
        raise ValueError(
            f"{ca_dir / 'ca.key'}: its key is {kind}; a CA signs with an RSA, "
            "EC, Ed25519 or Ed448 key"
        )
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    pem = serialization.Encoding.PEM
    if ca_key.public_key().public_bytes(pem, public) != ca.public_key().public_bytes(
        pem, public
    ):
        raise ValueError(f"{ca_dir / 'ca.key'} is not the key of {ca_dir / 'ca.crt'}")
    try:
        constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
        is_ca = constraints.value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ValueError(f"{ca_dir / 'ca.crt'} is not a CA certificate")
    names: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips
    ]
    names += [x509.DNSName(d) for d in dns_names]
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, (ips or dns_names)[0])]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        .add_extension(x509.SubjectAlternativeName(names), False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            False,
        )
        .sign(
            ca_key,
            None
            if isinstance(ca_key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey)
            else hashes.SHA256(),
        )
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    chain, key_file, ca_file = (
        out_dir / "tls.crt",
        out_dir / "tls.key",
        out_dir / "ca.crt",
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    chain.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca_file.write_bytes(ca_pem)
    return chain, key_file, ca_file
