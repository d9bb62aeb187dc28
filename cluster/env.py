"""Every environment variable moe-cluster reads, typed, defaulted and documented."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Env:
    # gRPC address `moe-cluster generate` and `info` talk to.
    target: str = "127.0.0.1:9000"
    # API key the CLI presents ("Authorization: Bearer KEY"); empty: none.
    api_key: str = ""
    # Config file `moe-cluster serve` loads when --config is not given.
    config: str = ""
    # PYTHONHASHSEED: vLLM seeds its prefix block hashes with it when set, so the
    # ingress's hashes (kvstore.block_hash) must too. None: unset.
    python_hash_seed: str | None = None
    # server.api_keys, where the app is built from a declarative
    # config (a RayService from a Secret): JSON, as server.api_keys. "": none.
    api_keys_json: str = ""


def read_env() -> Env:
    default = Env()
    return Env(
        target=os.environ.get("MOE_CLUSTER_TARGET", default.target),
        api_key=os.environ.get("MOE_CLUSTER_API_KEY", default.api_key),
        config=os.environ.get("MOE_CLUSTER_CONFIG", default.config),
        python_hash_seed=os.environ.get("PYTHONHASHSEED"),
        api_keys_json=os.environ.get("MOE_CLUSTER_API_KEYS", ""),
    )
