"""An EP group of 2 ranks against a single rank: start-up time and tokens/s.

    .venv/bin/python -m tests.perf.ep_group [--requests 16] [--max-tokens 64]

One node, 2 cores. Variants, each deployed fresh through the full app (router,
ingress, page store) on the tiny model:

- ``single``: one engine replica (one core);
- ``ep2``: one EP group of 2 ranks (DP attention + EP, one core each);
- ``replicas2``: two independent replicas (two cores), for scale.

Start-up is ``serve.run`` until every replica is ready. Throughput is completion
tokens over wall time for ``--requests`` concurrent greedy requests (random
64-token prompts, ``ignore_eos``), after one warm-up request; decode tokens/s of
one request alone is also reported. Writes ``tests/perf/results/ep_group.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from cluster.config import ClusterConfig
from tests.ep.two_nodes import complete

RESULTS = Path(__file__).parent / "results"
APP = "moe-cluster-ep-bench"
HTTP_PORT = 18133


def _config(model: str, replicas: int, ranks: int) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "model": {"path": model},
            "engine": {
                # EP groups on CPU run the float32 reference path (cluster.platform);
                # the single-rank variants run it too, for a like-for-like figure.
                "attention_backend": "CPU_MLA",
                "max_model_len": 512,
                "kv_cache_memory_bytes": 64 << 20,
                "max_num_seqs": 32,
                "enforce_eager": True,
                "omp_num_threads": 1,
            },
            "deployment": {"num_replicas": replicas, "num_cpus": 1},
            "router": {"max_running_per_replica": 32, "realtime_reserved_slots": 0},
            "kvstore": {"capacity_bytes": 64 << 20},
            "expert_parallel": {"ranks": ranks},
            "server": {"app_name": APP, "http_port": HTTP_PORT, "grpc_port": 18134},
        }
    )


async def _load(n: int, max_tokens: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 1000) for _ in range(64)] for _ in range(n + 1)]
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{HTTP_PORT}", timeout=600
    ) as client:
        first = await complete(client, prompts[0], max_tokens)
        t = time.perf_counter()
        rest = await asyncio.gather(
            *(complete(client, p, max_tokens) for p in prompts[1:])
        )
        wall = time.perf_counter() - t
    if any(out["status"] != 200 for out in [first, *rest]):
        raise RuntimeError(f"a request failed: {[out['status'] for out in rest]}")
    alone, alone_s = first["completion_tokens"], first["s"]
    tokens = [out["completion_tokens"] for out in rest]
    return {
        "one_request_tokens_per_s": round(alone / alone_s, 1),
        "concurrent_tokens_per_s": round(sum(tokens) / wall, 1),
        "concurrent_wall_s": round(wall, 2),
    }


def run(model: str, replicas: int, ranks: int, n: int, max_tokens: int) -> Any:
    from ray import serve

    from deployments.app import build_app, proxy_options
    from kvstore import actor as kv_actor
    from router import actor as router_actor

    config = _config(model, replicas, ranks)
    http, grpc_options = proxy_options(config)
    serve.start(http_options=http, grpc_options=grpc_options)
    t = time.monotonic()
    serve.run(build_app(config), name=APP, route_prefix="/")
    startup = time.monotonic() - t
    try:
        result = asyncio.run(_load(n, max_tokens, seed=ranks * 10 + replicas))
    finally:
        serve.delete(APP)
        router_actor.kill(APP)
        kv_actor.kill(APP)
        time.sleep(3)
    return {"startup_s": round(startup, 1), **result}


def main() -> None:
    import ray

    from deployments.app import prepare_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=".models/tiny-deepseek-v2")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--only", help="run one variant (no results written)")
    args = p.parse_args()
    model = prepare_model(
        ClusterConfig.model_validate(
            {"model": {"path": args.model, "build_tiny_if_missing": True}}
        )
    ).model.path
    ray.init(num_cpus=2, namespace="moe-cluster")
    variants = {"single": (1, 1), "ep2": (1, 2), "replicas2": (2, 1)}
    if args.only:
        variants = {args.only: variants[args.only]}
    results = {}
    for name, (replicas, ranks) in variants.items():
        results[name] = run(model, replicas, ranks, args.requests, args.max_tokens)
        print(name, results[name], flush=True)
    ray.shutdown()
    if args.only:
        return
    RESULTS.mkdir(exist_ok=True)
    meta = {"requests": args.requests, "max_tokens": args.max_tokens}
    (RESULTS / "ep_group.json").write_text(
        json.dumps({"settings": meta, "results": results}, indent=2) + "\n"
    )
    lines = [
        "# EP group of 2 ranks vs a single rank (tiny model, CPU, 2 cores)",
        "",
        f"{args.requests} concurrent requests of 64 prompt + {args.max_tokens} "
        "completion tokens; `python -m tests.perf.ep_group`.",
        "",
        "| variant | start-up s | 1 request tok/s | concurrent tok/s |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['startup_s']} | {r['one_request_tokens_per_s']} | "
            f"{r['concurrent_tokens_per_s']} |"
        )
    (RESULTS / "ep_group.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
