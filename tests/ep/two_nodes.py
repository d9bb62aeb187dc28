"""An EP group of 2 ranks on a 2-node Ray cluster started in-process.

    .venv/bin/python -m tests.ep.two_nodes MODEL_DIR OUT   # pickles the phases to OUT

Each node has one CPU and one unit of an accelerator-like resource (``accel``),
and the group asks one ``accel`` per rank under the spread strategy, so its ranks
must land one per node. Phases:

- ``placement``: start-up time, and where the ranks run.
- ``greedy``: greedy completions of fixed token prompts, one at a time (the
  caller compares them with a single-rank engine's).
- ``expert_load``: the group's measured expert histogram after a uniform
  workload (random tokens) and after a skewed one (one token repeated, so every
  position routes to the same experts).
- ``breaker``: realtime requests on uniform prompts run while skewed normal and
  background requests push the group's expert imbalance over its limit; the
  breaker's states over time and every request's outcome.
- ``recovery``: one rank's process is killed; how long the router keeps sending
  the group work, and how long until the whole group serves again.

Run in its own process by ``test_ep_group`` (a process joins one Ray cluster),
which asserts on what each phase recorded: the replicas' own ``EngineStats``, the
router's ``GroupStats`` and breaker ``Transition``s, and the HTTP answers.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import signal
import sys
import time
from typing import Any

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.config import ClusterConfig
from deployments.app import build_app, prepare_model, proxy_options
from deployments.protocol import EngineStats
from router import actor as router_actor
from router.stats import GroupStats, RouterStats
from tests.integration.conftest import ENGINE, engine_stats, free_port
from tests.waiting import wait_until

APP = "ep-two-nodes"
SKEWED_TOKEN = 7
MAX_IMBALANCE = 4.0


def config(model: str, http_port: int, grpc_port: int) -> ClusterConfig:
    return prepare_model(
        ClusterConfig.model_validate(
            {
                "model": {"path": model},
                "engine": {**ENGINE, "expert_load_window_s": 3},
                "deployment": {
                    "num_replicas": 1,
                    "num_cpus": 1,
                    "health_check_period_s": 2,
                    "max_ongoing_requests": 16,
                },
                "router": {
                    "max_running_per_replica": 8,
                    "realtime_reserved_slots": 2,
                    "replica_stale_s": 2,
                    "expert_max_imbalance": MAX_IMBALANCE,
                    "expert_normal_factor": 1.5,
                    "expert_probe_s": 2,
                    "expert_min_window_tokens": 256,
                },
                "kvstore": {"capacity_bytes": 64 << 20},
                "expert_parallel": {
                    "ranks": 2,
                    "placement": "spread",
                    "accelerator": "accel",
                },
                "server": {
                    "http_port": http_port,
                    "grpc_port": grpc_port,
                    "app_name": APP,
                },
            }
        )
    )


PHASES: dict[str, dict[str, Any]] = {}  # what each phase recorded, by phase


def emit(phase: str, **data: Any) -> None:
    PHASES[phase] = data
    print(f"phase {phase}: {data!r}", flush=True)


def main(model: str) -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"accel": 1}},
    )
    cluster.add_node(num_cpus=1, resources={"accel": 1})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    http_port, grpc_port = free_port(), free_port()
    cfg = config(model, http_port, grpc_port)
    # Both "nodes" share this machine's ports: one proxy, on the head.
    http, grpc_options = proxy_options(cfg)
    serve.start(proxy_location="HeadOnly", http_options=http, grpc_options=grpc_options)
    t = time.monotonic()
    serve.run(build_app(cfg), name=APP, route_prefix="/")
    startup_s = time.monotonic() - t
    handle = serve.get_deployment_handle("Engine", app_name=APP)
    router = ray.get_actor(
        router_actor.actor_name(APP), namespace=router_actor.NAMESPACE
    )
    ranks = rank_stats(handle, 2)
    emit(
        "placement",
        startup_s=round(startup_s, 1),
        nodes=len({n["NodeID"] for n in ray.nodes() if n["Alive"]}),
        ranks=ranks,
    )
    base = f"http://127.0.0.1:{http_port}"
    asyncio.run(workloads(base, cfg, router))
    recovery(base, cfg, handle, router, ranks)
    serve.shutdown()
    router_actor.kill(APP)
    ray.shutdown()
    cluster.shutdown()


def rank_stats(handle: Any, n: int, exclude_group: str = "") -> list[EngineStats]:
    """Stats of ``n`` ranks outside ``exclude_group``, each replica asked by name,
    once that many are up."""

    def ranks() -> list[EngineStats] | None:
        try:
            stats = engine_stats(handle)
        except Exception:  # a replica going or coming between listing and asking
            return None
        new = [s for s in stats.values() if s.group != exclude_group]
        return sorted(new, key=lambda s: s.rank) if len(new) >= n else None

    found: list[EngineStats] = wait_until(ranks, 300, f"{n} ranks up")
    return found


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1000) for _ in range(length)] for _ in range(n)]


GREEDY_PROMPTS = [p[: 20 + 60 * i] for i, p in enumerate(prompts(11, 3, 200))]


async def complete(
    client: httpx.AsyncClient,
    prompt: list[int],
    max_tokens: int,
    qos: str = "normal",
    tenant: str = "",
) -> dict[str, Any]:
    """One greedy completion (a tenant of its own keeps the page store from
    serving a repeated prompt's prefill from cache: its experts must run)."""
    t = time.monotonic()
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny-deepseek-v2",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "qos": qos,
            "tenant": tenant,
        },
    )
    out: dict[str, Any] = {"status": r.status_code, "s": time.monotonic() - t}
    if r.status_code == 200:
        body = r.json()
        out["text"] = body["choices"][0]["text"]
        out["completion_tokens"] = body["usage"]["completion_tokens"]
    return out


async def groups(router: Any) -> RouterStats:
    snap: RouterStats = await router.snapshot.remote()
    return snap


async def workloads(base: str, cfg: ClusterConfig, router: Any) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=180) as client:
        greedy = [(await complete(client, p, 16))["text"] for p in GREEDY_PROMPTS]
        emit("greedy", prompts=GREEDY_PROMPTS, texts=greedy)

        window = cfg.engine.expert_load_window_s + cfg.router.report_interval_s * 3
        histograms: dict[str, GroupStats] = {}
        for name, batch in (
            ("uniform", prompts(5, 6, 300)),
            ("skewed", [[SKEWED_TOKEN] * 300] * 6),
        ):
            await asyncio.sleep(window)  # the previous workload leaves the window
            await asyncio.gather(
                *(
                    complete(client, p, 4, "realtime", f"{name}-{i}")
                    for i, p in enumerate(batch)
                )
            )
            await asyncio.sleep(cfg.router.report_interval_s * 3)
            snap = await groups(router)
            [histograms[name]] = snap.groups.values()
        emit("expert_load", **histograms)
        await asyncio.sleep(window)
        await breaker(client, router)


async def breaker(client: httpx.AsyncClient, router: Any) -> None:
    """Skewed normal and background requests open the group's breaker; realtime
    keeps flowing on uniform prompts."""
    t0 = time.monotonic()
    timeline: list[tuple[float, str, float]] = []
    done = asyncio.Event()

    async def watch() -> None:
        # Until the requests are done and the breaker has closed again.
        while not done.is_set() or timeline[-1][1] != "closed":
            snap = await groups(router)
            for g in snap.groups.values():
                state = g.expert_breaker or "closed"
                if not timeline or timeline[-1][1] != state:
                    timeline.append(
                        (round(time.monotonic() - t0, 2), state, g.pressure)
                    )
            await asyncio.sleep(0.1)

    async def send(qos: str, prompt: list[int], at: float) -> dict[str, Any]:
        await asyncio.sleep(at)
        sent = time.monotonic() - t0
        out = await complete(client, prompt, 4, qos, f"{qos}-{at}")
        out.pop("text", None)
        return {
            "qos": qos,
            "sent": round(sent, 2),
            "s": round(out["s"], 2),
            "status": out["status"],
        }

    watcher = asyncio.create_task(watch())
    skewed = [SKEWED_TOKEN] * 300
    # Realtime on uniform prompts for 12 s; from 1 s on, skewed background every
    # 0.25 s for 3 s and skewed normal every 0.5 s for 4 s.
    jobs = [send("realtime", p, 0.5 * i) for i, p in enumerate(prompts(9, 24, 200))]
    jobs += [send("background", skewed, 1.0 + 0.25 * i) for i in range(12)]
    jobs += [send("normal", skewed, 1.1 + 0.5 * i) for i in range(8)]
    results = await asyncio.gather(*jobs)
    done.set()
    await asyncio.wait_for(watcher, 60)
    snap = await groups(router)
    emit(
        "breaker",
        timeline=timeline,
        requests=sorted(results, key=lambda r: r["sent"]),
        transitions=[t for t in snap.transitions if t.kind == "group"],
    )


def recovery(
    base: str, cfg: ClusterConfig, handle: Any, router: Any, ranks: list[Any]
) -> None:
    """Kills rank 1's process; times the router's reaction and the group's return."""
    old_group = ranks[0].group
    t0 = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGKILL)
    stopped_s = None
    while stopped_s is None and time.monotonic() - t0 < 60:
        snap = ray.get(router.snapshot.remote())
        g = snap.groups.get(old_group)
        if g is None or not g.serving:
            stopped_s = time.monotonic() - t0
        time.sleep(0.1)
    new = rank_stats(handle, 2, exclude_group=old_group)
    ready_s = time.monotonic() - t0
    answer = asyncio.run(first_answer(base))
    served_s = time.monotonic() - t0
    emit(
        "recovery",
        router_stopped_s=None if stopped_s is None else round(stopped_s, 2),
        group_ready_s=round(ready_s, 1),
        first_answer_s=round(served_s, 1),
        new_group=new,
        old_group=old_group,
        old_ranks=ranks,
        text=answer["text"],
    )


async def first_answer(base: str) -> dict[str, Any]:
    """The first greedy prompt, asked until the group answers it."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while (out := await complete(client, GREEDY_PROMPTS[0], 16))["status"] != 200:
            await asyncio.sleep(0.5)
    return out


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    finally:
        with open(sys.argv[2], "wb") as f:
            pickle.dump(PHASES, f)
