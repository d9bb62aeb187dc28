"""The autoscaler with EP groups of 2 ranks on an in-process 2-node cluster:
a load step takes the app from 1 group to 2 and the idle after it back to 1,
each group's ranks spread one per node (``make bench-autoscale-ep``).

    .venv/bin/python -m tests.ep.autoscale_two_nodes MODEL_DIR

Each node has 2 CPUs and 2 units of ``accel``; a rank takes one CPU and one
``accel``, so two groups fit. Prints the phases as ``tests/perf/autoscale.py``
does, with the rank counts seen; writes ``tests/perf/results/autoscale_ep.json``.
"""

from __future__ import annotations

import json
import sys

import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.config import ClusterConfig
from deployments.app import build_app, prepare_model, proxy_options
from deployments.ingress.client import InferenceClient
from router import actor as router_actor
from tests.integration.conftest import free_port
from tests.perf import autoscale

APP = "ep-autoscale"


def main(model: str) -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"accel": 2}},
    )
    cluster.add_node(num_cpus=2, resources={"accel": 2})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    settings = autoscale.settings(model, APP, slots=4)
    settings["expert_parallel"] = {
        "ranks": 2,
        "placement": "spread",
        "accelerator": "accel",
    }
    # CPU EP groups run the float32 reference path.
    settings["engine"] |= {"attention_backend": "CPU_MLA"}
    settings["server"] |= {"http_port": free_port(), "grpc_port": free_port()}
    config = prepare_model(ClusterConfig.model_validate(settings))
    http, grpc_options = proxy_options(config)
    serve.start(proxy_location="HeadOnly", http_options=http, grpc_options=grpc_options)
    serve.run(build_app(config), name=APP, route_prefix="/")
    try:
        client = InferenceClient(f"127.0.0.1:{config.server.grpc_port}", "", APP)
        autoscale._one(client, "first", 0, autoscale.StepRun())
        # 2 ranks serve, each with the router's slots: twice that in streams.
        run = autoscale.run_step(
            client, APP, 4 * 4, settle_s=10, limit_s=300, start_replicas=2
        )
        result = autoscale.summary(run, start_replicas=2)
        result["rank_counts"] = sorted({n for _, n in run.replicas})
        print("result", json.dumps(result), flush=True)
        (autoscale.RESULTS / "autoscale_ep.json").write_text(
            json.dumps(result, indent=2) + "\n"
        )
    finally:
        serve.shutdown()
        router_actor.kill(APP)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
