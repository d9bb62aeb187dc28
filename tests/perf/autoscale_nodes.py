"""The load step of ``tests/perf/autoscale.py`` on a cluster that must grow a node:
Serve's autoscaler asks for a second engine replica, the replica waits for a CPU
no node has, and Ray's autoscaler adds a worker node for it; after the step, the
replica is stopped and the idle node removed.

    make bench-autoscale-nodes   # or: .venv/bin/python -m tests.perf.autoscale_nodes

The nodes come from Ray's fake multi-node provider (``RAY_FAKE_CLUSTER``): the
autoscaler's launcher starts each "node" as another raylet on this machine, so
the cluster grows exactly as it would on KubeRay, without pods. The head has one
CPU (the first engine replica takes it); the worker type has one CPU, from 0 to 1
nodes, removed after 15 s idle. Prints the phases, the node count over time, the
time from the step to the node joining, to the replica running on it and to its
first token, and from the step's end to the replica stopping and the node
leaving; failed requests (goal 0). Writes
``tests/perf/results/autoscale_nodes.json``, and exits non-zero unless a node
was added, an engine replica served from it, no request failed, and the cluster
came back to one node and one replica.

The launched nodes' processes are children of the autoscaler's monitor process;
any still running when the cluster shuts down are ended by their ids.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from tests.perf import autoscale

APP = "moe-cluster-autoscale-nodes"
WORKER_TYPE = "engine.cpu"
IDLE_TIMEOUT_MINUTES = 0.25


def cluster_config(gcs_address: str) -> dict[str, Any]:
    """A fake multi-node cluster: the head (1 CPU) and 0..1 worker of 1 CPU."""
    return {
        "cluster_name": "moe-cluster-fake",
        "max_workers": 1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {
                "resources": {"CPU": 1},
                "node_config": {},
                "max_workers": 0,
            },
            WORKER_TYPE: {
                "resources": {"CPU": 1, "object_store_memory": 200 << 20},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
        "docker": {},
        "auth": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


def engine_nodes(app: str) -> set[str]:
    """The nodes the app's live engine replicas are on (from the GCS)."""
    from ray._private import state

    cls = f"ServeReplica:{app}:Engine"
    return {
        a["Address"]["NodeID"]
        for a in state.actors().values()
        if a["ActorClassName"] == cls and a["State"] == "ALIVE"
    }


def _since(start: float, t: float | None) -> float | None:
    return round(t - start, 1) if t is not None else None


def _end_leftovers(pids: set[int]) -> list[int]:
    """Ends, by id, processes this run started that outlived the cluster."""
    from deployments.cli import end_processes

    left = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            pass
    return end_processes(left, timeout_s=30)


def main() -> None:
    import ray
    from ray import serve
    from ray.autoscaler._private.fake_multi_node.node_provider import (
        FAKE_HEAD_NODE_ID,
    )
    from ray.cluster_utils import Cluster

    from cluster.config import ClusterConfig
    from deployments.app import build_app, prepare_model, proxy_options
    from deployments.ingress.client import InferenceClient
    from router import actor as router_actor
    from tests.integration.conftest import free_port

    os.environ |= {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    gcs_port = free_port()
    ip = ray.util.get_node_ip_address()
    fd, path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cluster_config(f"{ip}:{gcs_port}"), f)
    # The provider knows the head by a fixed node id: the head's resource use
    # reaches the autoscaler only if its raylet takes that id.
    os.environ["RAY_OVERRIDE_NODE_ID_FOR_TESTING"] = FAKE_HEAD_NODE_ID
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "gcs_server_port": gcs_port,
            "autoscaling_config": path,
            "include_dashboard": False,
        },
    )
    del os.environ["RAY_OVERRIDE_NODE_ID_FOR_TESTING"]
    ours: set[int] = set()
    nodes: list[tuple[float, int]] = []
    stop = threading.Event()
    result: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, namespace="moe-cluster-bench")
        model = str(Path(".models/tiny-deepseek-v2").resolve())
        settings = autoscale.settings(model, APP)
        settings["server"] |= {"http_port": free_port(), "grpc_port": free_port()}
        config = prepare_model(ClusterConfig.model_validate(settings))
        http, grpc_options = proxy_options(config)
        serve.start(
            proxy_location="HeadOnly", http_options=http, grpc_options=grpc_options
        )
        serve.run(build_app(config), name=APP, route_prefix="/")
        client = InferenceClient(f"127.0.0.1:{config.server.grpc_port}", "", APP)
        autoscale._one(client, "first", 0, autoscale.StepRun())
        start_nodes = alive_nodes()
        head_engines = engine_nodes(APP)
        print(f"nodes at start: {start_nodes}", flush=True)

        seen_on: set[str] = set()

        def watch() -> None:
            while not stop.is_set():
                nodes.append((time.monotonic(), alive_nodes()))
                seen_on.update(engine_nodes(APP))
                ours.update(p.pid for p in psutil.Process().children(recursive=True))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        slots = config.router.max_running_per_replica
        run = autoscale.run_step(client, APP, 2 * slots, settle_s=10, limit_s=300)
        # The extra replica is gone; the node goes once idle for the timeout.
        deadline = time.monotonic() + IDLE_TIMEOUT_MINUTES * 60 + 90
        while alive_nodes() > start_nodes and time.monotonic() < deadline:
            time.sleep(1)
        stop.set()
        watcher.join()
        result = autoscale.summary(run)
        step_at = run.t0 + run.phases["step"][0]
        back_at = run.t0 + run.phases["back"][0]
        joined = next((t for t, n in nodes if n > start_nodes), None)
        left = next(
            (t for t, n in nodes if joined and t > back_at and n == start_nodes),
            None,
        )
        running = next((run.t0 + t for t, n in run.replicas if n > 1), None)
        result |= {
            "nodes_start": start_nodes,
            "nodes_max": max(n for _, n in nodes),
            "nodes_end": alive_nodes(),
            "step_to_node_joined_s": _since(step_at, joined),
            "step_to_replica_running_s": _since(step_at, running),
            "back_to_node_removed_s": _since(back_at, left),
            # Node ids of the fake provider's nodes: fff...00001 and up.
            "engine_nodes": sorted(seen_on),
            "head_engine_nodes": sorted(head_engines),
            "node_timeline": [
                (round(t - run.t0, 1), n)
                for t, n in nodes[:: max(1, len(nodes) // 100)]
            ],
        }
    finally:
        stop.set()
        serve.shutdown()
        router_actor.kill(APP)
        ray.shutdown()
        cluster.shutdown()
        os.unlink(path)
        ended = _end_leftovers(ours)
        if ended:
            print(f"ended {len(ended)} processes the cluster left: {ended}")
    shown = {k: v for k, v in result.items() if k != "node_timeline"}
    print("result", json.dumps(shown, indent=2), flush=True)
    autoscale.RESULTS.mkdir(exist_ok=True)
    (autoscale.RESULTS / "autoscale_nodes.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )
    problems = check(result)
    if problems:
        raise SystemExit("; ".join(problems))


def check(result: dict[str, Any]) -> list[str]:
    """What the run must have shown."""
    problems = []
    if result.get("failed"):
        problems.append(f"{result['failed']} requests failed")
    if result.get("nodes_max", 0) <= result.get("nodes_start", 0):
        problems.append("no node was added")
    if not set(result.get("engine_nodes", [])) - set(result["head_engine_nodes"]):
        problems.append("no engine replica ran on an added node")
    if result.get("nodes_end") != result.get("nodes_start"):
        problems.append("the added node was not removed")
    if result.get("replicas_end") != 1:
        problems.append("the extra replica was not stopped")
    return problems


if __name__ == "__main__":
    main()
