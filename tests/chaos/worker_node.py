"""A whole worker node lost under steady greedy load, on a 2-node Ray cluster
started in-process.

    .venv/bin/python -m tests.chaos.worker_node MODEL_DIR OUT   # pickles a Row to OUT

Each node has one CPU, so the app's two engine replicas (one CPU each) run one per
node; the proxy and the ingress run on the head (the ingress is placed there: its
own loss is the suite's ingress row), as the router and the page store directory
do (every singleton runs on the head node). Six closed-loop greedy gRPC streams
(the chaos suite's load) run for 3 s; then the worker node is removed without
warning: its raylet, its engine replica and that engine's vLLM processes, its page
store. The row counts what the clients saw, as the suite's other rows do: the streams
on the lost node's engine resume on the head's from the tokens sent (recomputed: the
node's page store went with it).

Run in its own process by ``tests/integration/test_chaos.py`` (a process joins one
Ray cluster).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.actors import HEAD_NODE
from cluster.config import ClusterConfig
from deployments import app as app_module
from deployments.app import build_app, prepare_model, proxy_options
from deployments.ingress.client import InferenceClient
from kvstore import actor as kv_actor
from router import actor as router_actor
from tests.chaos import load
from tests.integration.conftest import ENGINE, engine_stats, free_port
from tests.waiting import wait_until

APP = "chaos-two-nodes"


def config(model: str, http_port: int, grpc_port: int) -> ClusterConfig:
    return prepare_model(
        ClusterConfig.model_validate(
            {
                "model": {"path": model},
                "engine": ENGINE,
                "deployment": {
                    "num_replicas": 2,
                    "num_cpus": 1,
                    "health_check_period_s": 2,
                    "max_ongoing_requests": 16,
                },
                "router": {
                    "max_running_per_replica": 8,
                    "realtime_reserved_slots": 2,
                    "replica_stale_s": 2,
                    "report_interval_s": 0.25,
                },
                "kvstore": {"capacity_bytes": 64 << 20, "sync_interval_s": 0.25},
                "server": {
                    "http_port": http_port,
                    "grpc_port": grpc_port,
                    "app_name": APP,
                },
            }
        )
    )


def _ingress_on_the_head(config: ClusterConfig) -> dict[str, Any]:
    options = INGRESS_OPTIONS(config)
    actor = options["ray_actor_options"] | {"resources": {HEAD_NODE: 0.001}}
    return options | {"ray_actor_options": actor}


INGRESS_OPTIONS = app_module.ingress_options


def main(model: str, out_path: str) -> None:
    app_module.ingress_options = _ingress_on_the_head
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    http_port, grpc_port = free_port(), free_port()
    cfg = config(model, http_port, grpc_port)
    # Both "nodes" share this machine's ports: one proxy, on the head.
    http, grpc_options = proxy_options(cfg)
    serve.start(proxy_location="HeadOnly", http_options=http, grpc_options=grpc_options)
    serve.run(build_app(cfg), name=APP, route_prefix="/")
    handle = serve.get_deployment_handle("Engine", app_name=APP)
    replicas = wait_until(
        lambda: s if len(s := engine_stats(handle)) == 2 else None, 120, "2 replicas"
    )
    nodes = {s.node_id for s in replicas.values()}
    assert len(nodes) == 2, "one engine replica per node"
    head = cluster.head_node.node_id
    for name in (router_actor.actor_name(APP), kv_actor.directory_name(APP)):
        assert _node_of(name) == head, f"{name} runs on the head node"
    wait_until(
        lambda: len(_router(APP).replicas) == 2, 60, "the router to see 2 replicas"
    )

    def connect() -> InferenceClient:
        return InferenceClient(f"127.0.0.1:{grpc_port}", "", APP)

    row = load.kill_under_load(
        "whole worker node (2-node cluster)",
        connect,
        load.reference(connect),
        lambda: cluster.remove_node(worker, allow_graceful=False),
    )
    print(f"row {row!r}", flush=True)
    with open(out_path, "wb") as f:
        pickle.dump(row, f)
    serve.shutdown()
    router_actor.kill(APP)
    kv_actor.kill(APP)
    ray.shutdown()
    cluster.shutdown()


def _node_of(actor_name: str) -> str:
    from ray.util.state import list_actors

    def alive() -> Any:
        return list_actors(filters=[("name", "=", actor_name), ("state", "=", "ALIVE")])

    (actor,) = wait_until(alive, 60, f"{actor_name} alive")
    return str(actor.node_id)


def _router(app: str) -> Any:
    name = router_actor.actor_name(app)
    handle = ray.get_actor(name, namespace=router_actor.NAMESPACE)
    return ray.get(handle.snapshot.remote(), timeout=30)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
