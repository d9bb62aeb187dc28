"""One real Ray cluster with the moe-cluster app, shared by every integration test.

Two vLLM engine replicas on the tiny model (one CPU each), the gRPC and HTTP
proxies on free loopback ports, an API key configured so authentication is on.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig
from deployments.client import InferenceClient

API_KEY = "test-key-123"


# The engines of the session's app. tests/ep/two_nodes.py runs its EP group with the
# same settings: its greedy tokens are compared with these engines'.
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "omp_num_threads": 1,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    config: ClusterConfig
    grpc_target: str
    http_base: str
    api_key: str
    metrics_url: str  # Ray's Prometheus endpoint

    def client(self, api_key: str | None = None) -> InferenceClient:
        return InferenceClient(
            self.grpc_target, self.api_key if api_key is None else api_key
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    # Modules that break the shared cluster (and wait for it to heal) run last.
    items.sort(key=lambda item: bool(getattr(item.module, "RUN_LAST", False)))


@pytest.fixture(scope="session")
def served(tiny_model: Path) -> Iterator[Served]:
    import ray
    from ray import serve

    from deployments.app import deploy, prepare_model

    config = prepare_model(
        ClusterConfig.model_validate(
            {
                "model": {"path": str(tiny_model)},
                "engine": ENGINE,
                "deployment": {
                    "num_replicas": 2,
                    "num_cpus": 1,
                    "health_check_period_s": 2,
                    "max_ongoing_requests": 8,
                },
                "router": {
                    # 2 replicas x 6 running; small queues, so the overload test
                    # can fill them while the other tests' bursts (8) still fit.
                    "max_running_per_replica": 6,
                    "realtime_reserved_slots": 2,
                    "max_queued": {"realtime": 8, "normal": 12, "background": 64},
                    "breaker_open_s": 3,
                    "report_interval_s": 0.25,
                },
                "kvstore": {
                    # 200 pages of the tiny model (147 KiB each): the eviction
                    # test can fill it.
                    "capacity_bytes": 200 * 147456,
                    "sync_interval_s": 0.25,
                },
                "server": {
                    "http_port": free_port(),
                    "grpc_port": free_port(),
                    "api_keys": [API_KEY],
                    "max_prompt_bytes": 4096,
                    "app_name": "moe-cluster-test",
                },
            }
        )
    )
    metrics_port = free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace="moe-cluster-test",
        _metrics_export_port=metrics_port,
    )
    deploy(config)
    s = config.server
    yield Served(
        config,
        f"127.0.0.1:{s.grpc_port}",
        f"http://127.0.0.1:{s.http_port}",
        API_KEY,
        f"http://127.0.0.1:{metrics_port}/metrics",
    )
    serve.shutdown()
    from kvstore import actor as kv_actor

    kv_actor.kill(config.server.app_name)  # unlinks the arenas
    ray.shutdown()


@pytest.fixture(scope="session")
def engine_handle(served: Served) -> Any:
    from ray import serve

    return serve.get_deployment_handle("Engine", served.config.server.app_name)


def engine_stats(engine_handle: Any) -> dict[str, Any]:
    """``EngineStats`` of each engine replica, by replica id.

    The handle picks a replica at random per call; 20 calls reach both replicas
    except with probability 2**-19.
    """
    stats = [engine_handle.stats.remote().result(timeout_s=30) for _ in range(20)]
    return {s.replica_id: s for s in stats}


def metric_lines(served: Served, name: str) -> list[str]:
    """Samples of ``name`` on Ray's Prometheus endpoint (empty until exported)."""
    import httpx

    try:
        body = httpx.get(served.metrics_url, timeout=5).text
    except httpx.HTTPError:
        return []
    return [line for line in body.splitlines() if line.startswith(name + "{")]


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls ``condition`` until it returns a truthy value or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)
