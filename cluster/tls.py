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
