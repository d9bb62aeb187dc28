"""One real Ray cluster with the moe-cluster app, shared by every integration test.

Two vLLM engine replicas on the tiny model (one CPU each), the gRPC and HTTP
proxies on free loopback ports, an API key configured so authentication is on.
The engines get what ``engine.attention_backend: auto`` gives on this CPU
(``PLATFORM``: AMX_MLA with bfloat16 and 128-token blocks where the CPU has AMX,
the reference CPU_MLA with float32 and 16-token blocks elsewhere); tests read
block sizes and page shapes from it. ``test_backends.py`` runs the other path
beside it where this CPU can.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster import tracing
from cluster.config import ClusterConfig
from cluster.platform import EnginePlatform
from deployments.ingress.client import InferenceClient
from tests.otlp_receiver import OTLPReceiver
from tests.waiting import wait_until  # noqa: F401 (the tests import it from here)

API_KEY = "test-key-123"  # any tenant: the tests name several
TENANT_KEY = "acme-key-456"  # bound to the acme tenants (test_tenants.py)
ACME_TENANTS = ["acme", "acme-eu"]
METERED_TENANT = "metered"  # rate-limited (test_tenants.py)


# The engines of the session's app. tests/ep/two_nodes.py runs its EP group with the
# same settings: its greedy tokens are compared with these engines'.
ENGINE: dict[str, Any] = {
    # auto: what this CPU gets. MOE_CLUSTER_TEST_BACKEND=CPU_MLA runs the session
    # on the reference backend instead (what a CPU without AMX gets), so an AMX
    # machine can run the whole suite the way such a machine does: `make
    # test-cpu-mla`.
    "attention_backend": os.environ.get("MOE_CLUSTER_TEST_BACKEND", "auto"),
    "max_model_len": 2048,  # the tiny model's positions: 16 blocks of 128
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "omp_num_threads": 1,
    # One background request decodes beside realtime, an engine with only
    # background idles 80% of its time while the other holds realtime, and a
    # step computes at most 4 tokens of background prompts, or one whole prompt
    # where vLLM does not chunk them (test_batch_guard.py).
    "realtime_batch_mates": 1,
    "background_cpu_yield": 0.8,
    "background_prefill_tokens": 4,
}
# What the session's engines run with on this machine (they report it back).
PLATFORM: EnginePlatform = ClusterConfig.model_validate(
    {"engine": ENGINE}
).engine_platform()
TINY_LAYERS, TINY_LATENT = 4, 576  # the tiny model's MLA layers and latent width


def page_bytes(p: EnginePlatform) -> int:
    """One KV page of the tiny model: every layer's block of latents."""
    itemsize = 2 if p.dtype in ("bfloat16", "float16") else 4
    return TINY_LAYERS * p.block_size * TINY_LATENT * itemsize


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
    application: str = ""  # Serve app named in gRPC calls ("": the only one)
    traces: OTLPReceiver | None = None  # where every process exports its spans

    def client(self, api_key: str | None = None) -> InferenceClient:
        return InferenceClient(
            self.grpc_target,
            self.api_key if api_key is None else api_key,
            self.application,
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    items.sort(key=_order)


def _order(item: pytest.Item) -> int:
    """Tests that start a Ray cluster of their own in a child process (their
    module sets ``OWN_CLUSTER``) run first, before the shared cluster starts: its
    processes keep working while idle (reports, store syncs, Serve's control
    loop), on the cores the child's processes start on. Those that also use the
    shared cluster keep their place. Modules that break the shared cluster (and
    wait for it to heal) run last (``RUN_LAST``)."""
    module = getattr(item, "module", None)
    if getattr(module, "OWN_CLUSTER", False) and "served" not in getattr(
        item, "fixturenames", ()
    ):
        return 0
    return 2 if getattr(module, "RUN_LAST", False) else 1


def app_settings(tiny_model: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """The session app's config mapping, each of ``sections`` merged into its
    section (another app beside it changes its name and what it tests)."""
    settings: dict[str, Any] = {
        "model": {"path": str(tiny_model)},
        "engine": ENGINE,
        "deployment": {
            "num_replicas": 2,
            "num_cpus": 1,
            "health_check_period_s": 2,
            "max_ongoing_requests": 8,
            # A stopped replica's streams run this long, then move (test_drain).
            "drain_timeout_s": 4,
        },
        "router": {
            # 2 replicas x 6 running; small queues, so the overload test
            # can fill them while the other tests' bursts (8) still fit.
            "max_running_per_replica": 6,
            "realtime_reserved_slots": 2,
            "max_queued": {"realtime": 8, "normal": 12, "background": 64},
            "breaker_open_s": 3,
            "report_interval_s": 0.25,
            # A tenant only test_tenants.py names: 2 at once, then one per 5 s.
            "tenant_rate_limits": {
                METERED_TENANT: {"requests_per_s": 0.2, "request_burst": 2}
            },
        },
        "kvstore": {
            # 64 pages of the tiny model: the eviction test can fill it.
            "capacity_bytes": 64 * page_bytes(PLATFORM),
            "sync_interval_s": 0.25,
        },
        "server": {
            "http_port": free_port(),
            "grpc_port": free_port(),
            "api_keys": [
                {"key": API_KEY, "tenants": ["", "*"]},
                {"key": TENANT_KEY, "tenants": ACME_TENANTS},
            ],
            "max_prompt_bytes": 4096,
            "app_name": "moe-cluster-test",
        },
    }
    for name, values in sections.items():
        settings[name] = {**settings.get(name, {}), **values}
    return settings


@pytest.fixture(scope="session")
def served(tiny_model: Path) -> Iterator[Served]:
    import ray
    from ray import serve

    from deployments.app import deploy, prepare_model
    from deployments.ray_connect import logging_config

    config = prepare_model(ClusterConfig.model_validate(app_settings(tiny_model)))
    assert config.engine_platform() == PLATFORM
    metrics_port = free_port()
    # Traces on, the standard way, before Ray starts: every worker inherits it.
    receiver_port = free_port()
    os.environ.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}",
            "OTEL_SERVICE_NAME": "moe-cluster-test",
            "OTEL_BSP_SCHEDULE_DELAY": "200",  # export within 0.2 s
        }
    )
    tracing.apply_serve_env(tracing.settings())
    os.environ.update(config.server.serve_env())  # as `moe-cluster serve` does
    # A new local cluster, whatever a killed run left in Ray's temp directory.
    # 4 logical CPUs on 2 cores: another app's engines (test_backends.py) run
    # beside the session's, which idle meanwhile.
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        namespace="moe-cluster-test",
        _metrics_export_port=metrics_port,
        logging_config=logging_config("TEXT"),
    )
    # Started after Ray: a gRPC server started before ray.init kept Ray's
    # dashboard from starting.
    receiver = OTLPReceiver(receiver_port).start()
    # Scaled from outside by test_drain.py, as an external autoscaler does.
    deploy(config, external_scaler=True)
    # Every test below runs on the backend the header names: the engines say so.
    handle = serve.get_deployment_handle("Engine", config.server.app_name)
    for stats in engine_stats(handle).values():
        got = (stats.attention_backend, stats.dtype, stats.block_size)
        assert got == (PLATFORM.backend.value, PLATFORM.dtype, PLATFORM.block_size)
    s = config.server
    yield Served(
        config,
        f"127.0.0.1:{s.grpc_port}",
        f"http://127.0.0.1:{s.http_port}",
        API_KEY,
        f"http://127.0.0.1:{metrics_port}/metrics",
        # Named in every call: with another app beside it (test_backends.py)
        # Serve's gRPC proxy needs to know which.
        application=s.app_name,
        traces=receiver,
    )
    serve.shutdown()
    from kvstore import actor as kv_actor

    kv_actor.kill(config.server.app_name)  # unlinks the arenas
    ray.shutdown()
    receiver.stop()


@contextmanager
def another_app(served: Served, settings: dict[str, Any]) -> Iterator[Served]:
    """A second app on the session's cluster and proxies (its own engines,
    router and page store), at ``/<app name>`` on HTTP and by name on gRPC;
    deleted, with its router and stores, on exit."""
    from ray import serve

    from deployments.app import build_app, prepare_model
    from kvstore import actor as kv_actor
    from router import actor as router_actor

    s = served.config.server
    settings["server"] |= {"http_port": s.http_port, "grpc_port": s.grpc_port}
    config = prepare_model(ClusterConfig.model_validate(settings))
    app = config.server.app_name
    try:
        # Inside: an app that fails to deploy is deleted too (a second app left
        # behind makes gRPC calls without "application" metadata ambiguous).
        serve.run(build_app(config), name=app, route_prefix=f"/{app}")
        yield Served(
            config,
            served.grpc_target,
            f"{served.http_base}/{app}",
            served.api_key,
            served.metrics_url,
            application=app,
            traces=served.traces,
        )
    finally:
        serve.delete(app)
        router_actor.kill(app)
        kv_actor.kill(app)


@pytest.fixture(scope="session")
def engine_handle(served: Served) -> Any:
    from ray import serve

    return serve.get_deployment_handle("Engine", served.config.server.app_name)


def engine_replica_ids(engine_handle: Any) -> list[str]:
    """The live replicas of the handle's deployment: Serve names each replica's
    actor ``SERVE_REPLICA::<app>#<deployment>#<replica id>``."""
    import ray

    prefix = f"SERVE_REPLICA::{engine_handle.app_name}#{engine_handle.deployment_name}#"
    return sorted(
        a["name"].removeprefix(prefix)
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    )


def engine_stats(engine_handle: Any) -> dict[str, Any]:
    """``EngineStats`` of each live engine replica, by replica id: each asked by
    name (``Pin``); one that left meanwhile is left out."""
    from deployments.protocol import Pin

    out = {}
    for rid in engine_replica_ids(engine_handle):
        try:
            s = engine_handle.stats.remote(Pin(rid)).result(timeout_s=30)
        except Exception:  # it is going away: leave it out
            continue
        if s.replica_id == rid:
            out[rid] = s
    return out


def metric_lines(served: Served, name: str) -> list[str]:
    """Samples of ``name`` on Ray's Prometheus endpoint (empty until exported)."""
    import httpx

    try:
        body = httpx.get(served.metrics_url, timeout=5).text
    except httpx.HTTPError:
        return []
    return [line for line in body.splitlines() if line.startswith(name + "{")]
