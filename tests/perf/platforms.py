"""Each CPU attention path this machine can run: what it chose, tokens/s, idle CPU,
and prefix-policy hit rates with a caching engine.

    .venv/bin/python -m tests.perf.platforms [--idle-s 10]

Paths: ``auto`` (what ``engine.attention_backend: auto`` gives on this CPU) and,
on a CPU with AMX, ``CPU_MLA`` forced (the reference backend). Each is deployed
fresh through the full app (ingress, router, page store), two engine replicas of
one core each, on the tiny model:

- chosen: the backend, dtype and block size the engines report;
- tokens/s: one greedy request of 64 prompt + 128 completion tokens alone, then 8
  at once (``ignore_eos``), over HTTP;
- idle CPU: every engine's processes (replica, engine core, worker) summed, over
  ``--idle-s`` seconds without requests, after 5 s of quiet;
- prefix hit rate (engines with their own prefix cache only): ``router.policy``
  prefix against least_loaded, the page store off so that only the engines' KV
  events say where a prefix lives; 24 shared 1024-token prefixes (more than one
  engine's 64 MiB cache holds), 192 requests that add 32 tokens each, 4 at a
  time. The hit rate is the router's: prompt blocks the
  chosen replica held, over prompt blocks placed; the cached share is the
  engines' own ``cached_tokens`` over prompt tokens.

``--before`` measures the cause of idle CPU on one bare engine instead: its
worker's CPU while idle, with the expert-load counters read every 0.5 s through
``collective_rpc`` (what every replica did before), and without.

Writes ``tests/perf/results/platforms.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform as host
import random
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from cluster.config import ClusterConfig
from cluster.platform import has_amx
from tests.ep.two_nodes import complete

RESULTS = Path(__file__).parent / "results"
APP = "moe-cluster-platform-bench"
HTTP_PORT, GRPC_PORT = 18143, 18144
# More shared prefixes than one engine's KV cache holds (24 x 1024 tokens against
# ~14.5k tokens of cache each at bfloat16): where each prefix goes decides what
# stays cached.
PREFIXES, PREFIX_LEN, SUFFIX_LEN, REQUESTS, CONCURRENCY = 24, 1024, 32, 192, 4
PREFIX_RUN_KV_BYTES = 64 << 20


def _config(model: str, backend: str, **sections: dict[str, Any]) -> ClusterConfig:
    settings: dict[str, Any] = {
        "model": {"path": model},
        "engine": {
            "attention_backend": backend,
            "max_model_len": 2048,
            "kv_cache_memory_bytes": 128 << 20,
            "max_num_seqs": 16,
            "enforce_eager": True,
            "omp_num_threads": 1,
        },
        "deployment": {"num_replicas": 2, "num_cpus": 1},
        "router": {"max_running_per_replica": 16, "realtime_reserved_slots": 0},
        "kvstore": {"capacity_bytes": 256 << 20},
        "server": {"app_name": APP, "http_port": HTTP_PORT, "grpc_port": GRPC_PORT},
    }
    for name, values in sections.items():
        settings[name] = {**settings[name], **values}
    return ClusterConfig.model_validate(settings).resolved()


class Deployed:
    """The app of one config on the connected cluster, for a ``with`` block."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config

    def __enter__(self) -> Deployed:
        from ray import serve

        from deployments.app import build_app, proxy_options

        http, grpc_options = proxy_options(self.config)
        serve.start(http_options=http, grpc_options=grpc_options)
        t = time.monotonic()
        serve.run(build_app(self.config), name=APP, route_prefix="/")
        self.startup_s = time.monotonic() - t
        return self

    def __exit__(self, *exc: object) -> None:
        from ray import serve

        from kvstore import actor as kv_actor
        from router import actor as router_actor

        serve.delete(APP)
        router_actor.kill(APP)
        kv_actor.kill(APP)
        time.sleep(3)

    def stats(self) -> dict[str, Any]:
        from ray import serve

        from tests.integration.conftest import engine_stats

        found: dict[str, Any] = engine_stats(serve.get_deployment_handle("Engine", APP))
        return found


async def _throughput(n: int, max_tokens: int) -> dict[str, float]:
    rng = random.Random(n)
    prompts = [[rng.randrange(3, 1000) for _ in range(64)] for _ in range(n + 2)]
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{HTTP_PORT}", timeout=600
    ) as client:
        await complete(client, prompts[0], 8)  # warm
        alone = await complete(client, prompts[1], max_tokens)
        t = time.perf_counter()
        outs = await asyncio.gather(
            *(complete(client, p, max_tokens) for p in prompts[2:])
        )
        wall = time.perf_counter() - t
    if any(o["status"] != 200 for o in [alone, *outs]):
        raise RuntimeError("a request failed")
    return {
        "single_stream_tok_s": round(alone["completion_tokens"] / alone["s"], 1),
        f"{n}_streams_tok_s": round(
            sum(o["completion_tokens"] for o in outs) / wall, 1
        ),
    }


def _idle_cpu(stats: dict[str, Any], seconds: float) -> list[float]:
    """CPU % of each engine (its replica process and all its children)."""
    trees = []
    for s in stats.values():
        root = psutil.Process(s.pid)
        trees.append([root, *root.children(recursive=True)])
    for tree in trees:
        for p in tree:
            p.cpu_percent(None)
    time.sleep(seconds)
    out = []
    for tree in trees:
        total = 0.0
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.cpu_percent(None)
        out.append(round(total, 1))
    return out


async def _shared_prefix_load() -> dict[str, Any]:
    rng = random.Random(7)
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)
    ]
    prompts = [
        prefixes[i % PREFIXES] + [rng.randrange(3, 1000) for _ in range(SUFFIX_LEN)]
        for i in range(REQUESTS)
    ]
    sem = asyncio.Semaphore(CONCURRENCY)
    cached, total = 0, 0

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal cached, total
        async with sem:
            r = await client.post(
                "/v1/completions",
                json={
                    "model": "tiny-deepseek-v2",
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            usage = r.json()["usage"]
            total += usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            cached += details.get("cached_tokens", 0)

    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{HTTP_PORT}", timeout=600
    ) as client:
        t = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - t
    return {"cached_share": round(cached / total, 3), "wall_s": round(wall, 2)}


def _router_snapshot() -> dict[str, Any]:
    import ray

    from router import actor as router_actor

    handle = ray.get_actor(
        router_actor.actor_name(APP), namespace=router_actor.NAMESPACE
    )
    snap: dict[str, Any] = ray.get(handle.snapshot.remote(), timeout=30).as_json()
    return snap


def run_path(model: str, backend: str, idle_s: float) -> dict[str, Any]:
    with Deployed(_config(model, backend)) as app:
        stats = app.stats()
        s = next(iter(stats.values()))
        result: dict[str, Any] = {
            "attention_backend": s.attention_backend,
            "dtype": s.dtype,
            "block_size": s.block_size,
            "prefix_caching": s.prefix_caching,
            "startup_s": round(app.startup_s, 1),
        }
        result |= asyncio.run(_throughput(8, 128))
        time.sleep(5)  # the last poll of the counters, then quiet
        result["idle_cpu_percent_per_engine"] = _idle_cpu(stats, idle_s)
    if result["prefix_caching"]:
        for policy in ("prefix", "least_loaded"):
            cfg = _config(
                model,
                backend,
                engine={"kv_cache_memory_bytes": PREFIX_RUN_KV_BYTES},
                router={"policy": policy},
                kvstore={"enabled": False},
            )
            with Deployed(cfg):
                load = asyncio.run(_shared_prefix_load())
                snap = _router_snapshot()
            rate = snap["prefix_hit_rate"]
            result[f"shared_prefix_{policy}"] = load | {
                "router_hit_rate": None if rate is None else round(rate, 3),
                "routed": snap["routed"],
            }
    return result


def before(model: str, idle_s: float) -> dict[str, Any]:
    """A bare engine's worker CPU while idle: polled through collective_rpc every
    0.5 s, as every replica did, and not polled."""
    import os

    from vllm.v1.engine.async_llm import AsyncLLM

    from deployments.engine.args import engine_args, engine_env

    config = _config(model, "auto")
    os.environ.update(engine_env(config.engine))
    engine = AsyncLLM.from_engine_args(
        engine_args(config.model.path, "tiny-deepseek-v2", config.engine)
    )

    async def measure(poll: bool) -> float:
        await engine.collective_rpc("moe_expert_load_install")
        await asyncio.sleep(3)
        procs = psutil.Process().children(recursive=True)
        for p in procs:
            p.cpu_percent(None)
        end = time.monotonic() + idle_s
        while time.monotonic() < end:
            await asyncio.sleep(0.5)
            if poll:
                await engine.collective_rpc("moe_expert_load_take")
        return round(sum(p.cpu_percent(None) for p in procs), 1)

    async def both() -> dict[str, float]:
        return {
            "polled_every_0.5s_cpu_percent": await measure(True),
            "not_polled_cpu_percent": await measure(False),
        }

    try:
        return asyncio.run(both())
    finally:
        engine.shutdown()


def main() -> None:
    import ray

    from deployments.app import prepare_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=".models/tiny-deepseek-v2")
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--before", action="store_true", help="the idle-CPU cause only")
    p.add_argument("--only", help="one path (auto or CPU_MLA); no results written")
    args = p.parse_args()
    model = prepare_model(
        ClusterConfig.model_validate(
            {"model": {"path": args.model, "build_tiny_if_missing": True}}
        )
    ).model.path
    cpu = "AMX" if has_amx() else "no AMX"
    if args.before:
        print(json.dumps({"cpu": cpu, **before(model, args.idle_s)}), flush=True)
        return
    paths = ["auto", "CPU_MLA"] if has_amx() else ["auto"]
    if args.only:
        paths = [args.only]
    ray.init(address="local", num_cpus=2, namespace="moe-cluster-bench")
    results = {}
    for backend in paths:
        results[backend] = run_path(model, backend, args.idle_s)
        print(backend, json.dumps(results[backend]), flush=True)
    ray.shutdown()
    if args.only:
        return
    RESULTS.mkdir(exist_ok=True)
    meta = {"cpu": cpu, "processor": host.processor() or host.machine()}
    (RESULTS / "platforms.json").write_text(
        json.dumps({"machine": meta, "results": results}, indent=2) + "\n"
    )
    lines = [
        f"# CPU attention paths ({cpu}, 2 cores, tiny model)",
        "",
        "`python -m tests.perf.platforms`: two engine replicas of one core each,",
        "full app, HTTP; 64 prompt + 128 completion tokens per request.",
        "",
        "| path | backend | dtype | block | 1 stream tok/s | 8 streams tok/s | "
        "idle CPU % per engine |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['attention_backend']} | {r['dtype']} | {r['block_size']} "
            f"| {r['single_stream_tok_s']} | {r['8_streams_tok_s']} | "
            f"{', '.join(map(str, r['idle_cpu_percent_per_engine']))} |"
        )
    for name, r in results.items():
        for policy in ("prefix", "least_loaded"):
            if (s := r.get(f"shared_prefix_{policy}")) is not None:
                if policy == "prefix":
                    lines += [
                        "",
                        f"Shared prefixes on {name} ({PREFIXES} x {PREFIX_LEN} tokens, "
                        f"{REQUESTS} requests, {CONCURRENCY} at a time, store off):",
                        "",
                        "| policy | router hit rate | cached share | wall s |",
                        "|---|---|---|---|",
                    ]
                lines.append(
                    f"| {policy} | {s['router_hit_rate']} | {s['cached_share']} | "
                    f"{s['wall_s']} |"
                )
    (RESULTS / "platforms.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
