"""OpenAI HTTP over TLS from a certificate and key in the config (Ray Serve's
HTTP proxy serves HTTPS; its gRPC proxy has no TLS setting in Ray 2.60).

Serve's proxies are per Ray cluster, so this runs its own small cluster in a
child process, with a certificate made here."""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.config import ClusterConfig
from tests.integration.conftest import free_port
from tests.otlp_receiver import untraced_env

OWN_CLUSTER = True  # runs before the shared cluster starts (conftest.py)

CHILD = """
import sys, time, json
import ray
from ray import serve
from cluster.config import ClusterConfig
from deployments.app import proxy_options

config = ClusterConfig.model_validate(json.loads(sys.argv[1])).resolved()
ray.init(num_cpus=1, include_dashboard=False)

@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Hello:
    def __call__(self, request) -> str:
        return "hello over tls"

http, grpc_options = proxy_options(config)
serve.start(http_options=http, grpc_options=grpc_options)
serve.run(Hello.bind(), name="tls", route_prefix="/")
print("READY", flush=True)
sys.stdin.readline()  # until the test is done
serve.shutdown()
ray.shutdown()
"""


def self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_the_http_proxy_serves_https_from_the_configs_certificate(
    tmp_path: Path,
) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    settings = {
        "server": {
            "http_port": port,
            "grpc_port": free_port(),
            "tls": {"certfile": str(cert), "keyfile": str(key)},
        }
    }
    ClusterConfig.model_validate(settings)  # the config the child gets is valid
    # Its own cluster (not the session's), exporting no traces.
    env = {k: v for k, v in untraced_env().items() if k != "RAY_ADDRESS"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(settings)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 180
        while child.stdout.readline().strip() != "READY":
            assert child.poll() is None and time.monotonic() < deadline, "no cluster"
        r = httpx.get(f"https://127.0.0.1:{port}/", verify=str(cert), timeout=30)
        assert (r.status_code, r.text) == (200, "hello over tls")
        with pytest.raises(httpx.HTTPError):  # plaintext is not served
            httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        with pytest.raises(httpx.ConnectError):  # nor a certificate it cannot verify
            httpx.get(f"https://127.0.0.1:{port}/", timeout=10)
    finally:
        if child.stdin is not None:
            child.stdin.write("\n")
            child.stdin.flush()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.terminate()
            child.wait(30)


def test_a_tls_config_names_a_missing_file(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"server.tls.certfile: no such file"):
        ClusterConfig.model_validate(
            {"server": {"tls": {"certfile": str(tmp_path / "x"), "keyfile": "y"}}}
        )
