"""Joining a Ray cluster without ever waiting on one that is not there.

``ray.init()`` without an address follows ``RAY_ADDRESS`` or the
``ray_current_cluster`` file in Ray's temp directory; a file left by a killed run
names a dead GCS, and Ray then retries it for minutes. Here no address means a new
local cluster, and an address (``auto`` included) is probed first, so one that
does not answer fails in seconds with its name.
"""

from __future__ import annotations

import socket
from typing import Any

PROBE_TIMEOUT_S = 3.0


def resolve_address(address: str | None) -> str | None:
    """host:port of the cluster to join, or None for a new local one."""
    if address is None or address == "local":
        return None
    from ray._private.services import canonicalize_bootstrap_address

    try:
        target = canonicalize_bootstrap_address(address)
    except ConnectionError as e:  # "auto" with no cluster to be found
        msg = f"no Ray cluster found for --address {address}: {e}"
        raise ConnectionError(msg) from None
    if target is None:
        raise ConnectionError(f"no Ray cluster found for --address {address}")
    return str(target)


def probe(target: str, timeout_s: float = PROBE_TIMEOUT_S, given: str = "") -> None:
    """Raises ConnectionError unless something accepts connections at host:port
    (``given``: the address as the user wrote it, for the message)."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout_s):
            pass
    except (OSError, ValueError) as e:
        name = target if given in ("", target) else f"{given} ({target})"
        raise ConnectionError(f"no Ray cluster answers at {name}: {e}") from None


def logging_config(encoding: str = "TEXT") -> Any:
    """Ray's structured logging for every worker: the root logger at INFO through
    Ray's formatter, which writes each record's extra fields (moe-cluster's
    ``moe_request_id``, ``trace_id``, ``span_id``, see ``cluster.tracing``) as JSON
    keys or ``key=value`` after the message, and names the logger."""
    import ray

    return ray.LoggingConfig(
        encoding=encoding, log_level="INFO", additional_log_standard_attrs=["name"]
    )


def init_ray(address: str | None, **kwargs: Any) -> None:
    """``ray.init`` on a new local cluster (``address`` None or "local", with
    ``kwargs`` such as ``num_cpus``) or on the cluster at ``address`` once its GCS
    answers. Raises ConnectionError naming an address that does not answer."""
    import ray

    target = resolve_address(address)
    if target is None:
        ray.init(address="local", **kwargs)
        return
    probe(target, given=address or "")
    ray.init(address=target, **kwargs)
