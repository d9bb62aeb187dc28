"""Starts one serving system on the tiny model, in this process, until killed.

    python -m tests.perf.peers ray-serve-llm --port 8100 --replicas 2 [--prefix-router]
    python -m tests.perf.peers moe-cluster --port 8100 --replicas 1 [--no-router]

Used by ``compare_peers``; bare vLLM is started with its own ``vllm serve``. Every
system gets the same engine settings and one CPU core per replica. With
``--scalable`` the engines' replica count is set from outside, as an external
autoscaler does (Serve's ``update_deployment_replicas``): SIGUSR1 adds one, and
the log says ``SCALED <replicas> <seconds> <perf_counter>`` once it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from cluster.config import ClusterConfig
from cluster.tiny_model import write_tiny_model
from deployments.cli import end_leftover_haproxy, wait_for_stop_signal

MODEL_DIR = Path(".models/tiny-deepseek-v2")
NAME = "tiny-deepseek-v2"
# Every peer's attention backend: what moe-cluster's ``auto`` picks on this CPU, or
# the one this variable names (``CPU_MLA`` on an AMX machine measures the path a
# CPU without AMX takes: float32, 16-token blocks, no prefix cache in vLLM).
BACKEND_ENV = "MOE_CLUSTER_BENCH_BACKEND"
ENGINE = {
    "attention_backend": os.environ.get(BACKEND_ENV, "auto"),
    "max_model_len": 2048,
    "kv_cache_memory_bytes": 256 << 20,
    "max_num_seqs": 32,
    "enforce_eager": True,
}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def platform_kwargs() -> dict[str, object]:
    """The attention backend, dtype and block size moe-cluster's auto picks on this
    CPU (or the one ``MOE_CLUSTER_BENCH_BACKEND`` names), for the peers' engines."""
    p = ClusterConfig.model_validate(
        {"engine": {"attention_backend": ENGINE["attention_backend"]}}
    ).engine_platform()
    return {
        "attention_backend": p.vllm_backend,
        "dtype": p.dtype,
        "block_size": p.block_size,
    }


def vllm_command(port: int, stats: bool = True) -> list[str]:
    """vLLM's own OpenAI server, as `vllm serve` runs it: with its per-step
    statistics and Prometheus metrics, as moe-cluster's engines and Ray Serve LLM
    (``log_engine_metrics``) keep them too. ``stats=False`` adds
    ``--disable-log-stats``."""
    # (vllm-cpu 0.32.0's `vllm` script fails at start: it asks for the version of
    # a distribution named "vllm", but vllm-cpu installs as "vllm-cpu".)
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    p = platform_kwargs()
    return [
        *server, "--model", str(MODEL_DIR.resolve()), "--served-model-name", NAME,
        "--port", str(port), "--dtype", str(p["dtype"]),
        "--block-size", str(p["block_size"]),
        "--attention-backend", str(p["attention_backend"]),
        "--max-model-len", str(ENGINE["max_model_len"]),
        "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
        "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--enforce-eager",
        *([] if stats else ["--disable-log-stats"]),
    ]  # fmt: skip


def serve_ray_serve_llm(
    port: int,
    replicas: int,
    prefix_router: bool,
    engine: dict[str, object],
    scalable: bool = False,
) -> str:
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    # The replica actor takes no CPU of its own: the engine's bundle holds the one
    # core, as in moe-cluster (by default Ray Serve LLM reserves 1 + 1 per replica).
    deployment: dict[str, object] = {
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": 0},
    }
    if prefix_router:
        deployment["request_router_config"] = {
            "request_router_class": (
                "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
            )
        }
    config = LLMConfig(
        model_loading_config={
            "model_id": NAME,
            "model_source": str(MODEL_DIR.resolve()),
        },
        engine_kwargs={**engine, **platform_kwargs()},
        accelerator_config={"kind": "cpu"},
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config=deployment,
        runtime_env={"env_vars": ENV},
    )
    ray.init(num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_openai_app(
        {
            "llm_configs": [config],
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
        }
    )
    serve.run(app, name="rsllm", route_prefix="/", external_scaler_enabled=scalable)
    return "rsllm"


def serve_moe_cluster(
    port: int,
    replicas: int,
    router: bool = True,
    router_settings: str = "{}",
    engine_settings: str = "{}",
    server_settings: str = "{}",
    engine: dict[str, object] | None = None,
    scalable: bool = False,
    kvstore_settings: str = "{}",
) -> str:
    import ray

    from cluster.config import ClusterConfig
    from deployments.app import deploy, prepare_model
    from deployments.cli import lay_out_cores, trace_settings
    from deployments.ray_connect import logging_config

    config = prepare_model(
        ClusterConfig.model_validate(
            {
                "model": {"path": str(MODEL_DIR), "served_name": NAME},
                "engine": (engine or ENGINE)
                | {"omp_num_threads": 1}
                | json.loads(engine_settings),
                "deployment": {"num_replicas": replicas, "num_cpus": 1},
                "server": {"http_port": port, "grpc_port": port + 1}
                | json.loads(server_settings),
                "router": {"enabled": router} | json.loads(router_settings),
                "kvstore": json.loads(kvstore_settings),
            }
        )
    )
    os.environ.update(config.server.serve_env())
    trace_settings(config)  # as `moe-cluster serve`: OTEL_* in the environment
    print(f"moe-cluster: {lay_out_cores(config)}", flush=True)  # as it, too
    # Its logging too: the replicas' INFO lines (the ingress's access line among
    # them) are written as when it serves.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_config=logging_config(config.tracing.log_encoding),
    )
    deploy(config, external_scaler=scalable)
    return config.server.app_name


def add_engine_replica(app: str) -> None:
    """One more replica of the app's engine deployment (the one running the
    model: moe-cluster's ``Engine``, Ray Serve LLM's ``LLMServer``); prints
    ``SCALED <replicas> <seconds> <perf_counter>`` once Serve runs them all."""
    import ray
    from ray import serve
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    started = time.perf_counter()
    deployments = serve.status().applications[app].deployments
    name = next(d for d in deployments if d == "Engine" or NAME in d)
    wanted = sum(deployments[name].replica_states.values()) + 1
    controller = _get_global_client()._controller
    ray.get(
        controller.update_deployment_replicas.remote(DeploymentID(name, app), wanted)
    )
    while True:
        states = serve.status().applications[app].deployments[name].replica_states
        if states.get("RUNNING", 0) >= wanted:
            break
        time.sleep(0.2)
    # The clock the load generator's records use (CLOCK_MONOTONIC, as here).
    now = time.perf_counter()
    print(f"SCALED {wanted} {now - started:.2f} {now:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("system", choices=["ray-serve-llm", "moe-cluster"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--prefix-router", action="store_true")
    p.add_argument(
        "--no-router", action="store_true", help="moe-cluster: Serve's own routing"
    )
    p.add_argument(
        "--router-json", default="{}", help="moe-cluster: router settings (JSON)"
    )
    p.add_argument(
        "--engine-json", default="{}", help="moe-cluster: engine settings (JSON)"
    )
    p.add_argument(
        "--server-json", default="{}", help="moe-cluster: server settings (JSON)"
    )
    p.add_argument(
        "--kvstore-json", default="{}", help="moe-cluster: page store settings (JSON)"
    )
    p.add_argument(
        "--scalable",
        action="store_true",
        help="the engines' replica count is set from outside; SIGUSR1 adds one",
    )
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="each engine's KV cache (default: ENGINE's, 256 MiB)",
    )
    args = p.parse_args()
    engine = dict(ENGINE)
    if args.kv_cache_mib is not None:
        engine["kv_cache_memory_bytes"] = args.kv_cache_mib << 20
    os.environ.update(ENV)
    if not (MODEL_DIR / "config.json").exists():
        write_tiny_model(MODEL_DIR)
    if args.system == "ray-serve-llm":
        app = serve_ray_serve_llm(
            args.port, args.replicas, args.prefix_router, engine, args.scalable
        )
    else:
        app = serve_moe_cluster(
            args.port,
            args.replicas,
            not args.no_router,
            args.router_json,
            args.engine_json,
            args.server_json,
            engine,
            args.scalable,
            args.kvstore_json,
        )
    if args.scalable:
        signal.signal(
            signal.SIGUSR1,
            lambda *_: threading.Thread(target=add_engine_replica, args=(app,)).start(),
        )
    print("READY", flush=True)
    wait_for_stop_signal()
    import ray
    from ray import serve

    node_id = ray.get_runtime_context().get_node_id()
    serve.shutdown()  # engines shut down; `ray stop` alone would orphan them
    end_leftover_haproxy(node_id)  # server.haproxy: one a reload left behind


if __name__ == "__main__":
    main()
