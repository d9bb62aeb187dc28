"""The DeepSeekRouter on real engines: QoS under a flood, shedding, restart."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx

from deployments.proto import inference_pb2 as pb
from router import actor as router_actor
from router.stats import RouterStats
from tests.integration.conftest import Served, metric_lines, wait_until


@dataclass
class Result:
    code: grpc.StatusCode
    details: str
    ttft_s: float
    tokens: int
    replica: str


def generate(
    served: Served,
    ids: list[int],
    max_tokens: int,
    qos: int = pb.NORMAL,
    deadline_ms: int = 0,
) -> Result:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        qos=qos,
        deadline_ms=deadline_ms,
    )
    t0 = time.monotonic()
    ttft, tokens, replica = -1.0, 0, ""
    try:
        for msg in served.client().generate(request, timeout=180):
            if msg.HasField("chunk"):
                if ttft < 0:
                    ttft = time.monotonic() - t0
                tokens += len(msg.chunk.token_ids)
            else:
                replica = msg.finished.replica_id
        return Result(grpc.StatusCode.OK, "", ttft, tokens, replica)
    except grpc.RpcError as e:
        return Result(e.code(), e.details() or "", time.monotonic() - t0, tokens, "")


def router_snapshot(served: Served) -> RouterStats:
    import ray

    name = router_actor.actor_name(served.config.server.app_name)
    handle = ray.get_actor(name, namespace=router_actor.NAMESPACE)
    snap: RouterStats = ray.get(handle.snapshot.remote(), timeout=30)
    return snap


def test_impossible_deadline_is_shed_at_once(served: Served) -> None:
    r = generate(served, [5, 6, 7], 8, qos=pb.REALTIME, deadline_ms=1)
    assert r.code == grpc.StatusCode.RESOURCE_EXHAUSTED, r
    assert "expected time to first token" in r.details and "retry after" in r.details
    assert r.ttft_s < 1.0  # refused at once, not after waiting
    response = httpx.post(
        f"{served.http_base}/v1/completions",
        json={"model": "tiny-deepseek-v2", "prompt": [5, 6], "deadline_ms": 1},
        headers={"Authorization": f"Bearer {served.api_key}"},
        timeout=30,
    )
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) >= 1
    assert "deadline" in response.json()["error"]["message"]


def test_realtime_keeps_its_deadline_under_a_background_flood(served: Served) -> None:
    """36 background streams (3x what the replicas run at once) and, meanwhile,
    realtime requests with a 2 s deadline: every realtime request is served in
    time, and every background one still completes."""
    flood_n, realtime_n, deadline_ms = 36, 10, 2000
    with ThreadPoolExecutor(flood_n + realtime_n) as pool:
        flood = [
            pool.submit(generate, served, [40 + i, 41, 42], 96, pb.BACKGROUND)
            for i in range(flood_n)
        ]
        wait_until(
            lambda: router_snapshot(served).queued["background"] > 0,
            30,
            "the flood to fill every slot and queue behind them",
        )
        realtime = []
        for i in range(realtime_n):
            realtime.append(
                pool.submit(
                    generate, served, [300 + i, 5], 16, pb.REALTIME, deadline_ms
                )
            )
            time.sleep(0.2)  # pacing: realtime arrives while the flood runs
        rt = [f.result() for f in realtime]
        bg = [f.result() for f in flood]
    assert [r.code for r in rt] == [grpc.StatusCode.OK] * realtime_n, rt
    assert all(r.tokens == 16 and r.ttft_s < deadline_ms / 1000 for r in rt), [
        (r.tokens, round(r.ttft_s, 3), r.replica) for r in rt
    ]
    assert [r.code for r in bg] == [grpc.StatusCode.OK] * flood_n
    assert all(r.tokens == 96 for r in bg)
    bg_ttft = sorted(r.ttft_s for r in bg)
    print(
        f"realtime TTFT max {max(r.ttft_s for r in rt) * 1000:.0f} ms, median "
        f"{statistics.median(r.ttft_s for r in rt) * 1000:.0f} ms; background TTFT "
        f"median {statistics.median(bg_ttft) * 1000:.0f} ms, max {bg_ttft[-1]:.1f} s"
    )


def test_router_killed_mid_load_loses_no_request(served: Served) -> None:
    import ray

    name = router_actor.actor_name(served.config.server.app_name)
    handle = ray.get_actor(name, namespace=router_actor.NAMESPACE)
    results: list[Result] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        r = generate(served, [60 + i % 50, 7], 48, pb.NORMAL)
        with lock:
            results.append(r)

    def seen() -> int:
        snap = router_snapshot(served)
        return snap.admitted["normal"] + snap.queued["normal"]

    before = seen()
    with ThreadPoolExecutor(24) as pool:
        for i in range(12):  # in flight (and queued) when the router dies
            pool.submit(one, i)
        wait_until(lambda: seen() >= before + 12, 30, "12 requests at the router")
        ray.kill(handle, no_restart=False)
        killed_at = time.monotonic()
        for i in range(12, 24):  # arrive while it restarts
            pool.submit(one, i)
            time.sleep(0.05)  # pacing: they arrive over the restart
    assert len(results) == 24
    assert [r.code for r in results] == [grpc.StatusCode.OK] * 24, [
        (r.code, r.details) for r in results if r.code != grpc.StatusCode.OK
    ]
    assert all(r.tokens == 48 for r in results)

    def rebuilt() -> bool:
        return len(router_snapshot(served).replicas) == 2

    wait_until(rebuilt, 10, "the restarted router to learn both replicas")
    print(f"router state rebuilt {time.monotonic() - killed_at:.1f} s after the kill")


def test_background_streams_in_larger_batches(served: Served) -> None:
    """Background tokens come at most every engine.background_stream_interval_ms
    (500 ms): fewer messages through the proxies for the class that waits anyway."""

    def chunks(qos: int) -> tuple[int, float, int]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[70, 71]),
            sampling=pb.SamplingParams(max_tokens=96, temperature=0, ignore_eos=True),
            qos=qos,
        )
        t0 = time.monotonic()
        msgs = list(served.client().generate(request, timeout=60))
        tokens = sum(len(m.chunk.token_ids) for m in msgs if m.HasField("chunk"))
        return len(msgs) - 1, time.monotonic() - t0, tokens

    n_bg, took_bg, tokens_bg = chunks(pb.BACKGROUND)
    n_rt, _, tokens_rt = chunks(pb.REALTIME)
    assert tokens_bg == tokens_rt == 96
    assert n_bg <= took_bg / 0.5 + 2  # the first at once, then one per 500 ms
    assert n_rt > n_bg


def test_a_changed_router_config_replaces_the_router(served: Served) -> None:
    import ray

    from cluster.config import RouterConfig

    app, model = "config-change-test", served.config.model.path
    first = router_actor.get_or_create(RouterConfig(), app, model, replace=True)
    try:
        assert ray.get(first.config.remote(), timeout=30) == RouterConfig()
        same = router_actor.get_or_create(RouterConfig(), app, model, replace=True)
        assert same._actor_id == first._actor_id
        changed = RouterConfig(policy="weighted_round_robin")
        second = router_actor.get_or_create(changed, app, model, replace=True)
        assert second._actor_id != first._actor_id
        assert ray.get(second.config.remote(), timeout=30) == changed
        assert ray.get(second.snapshot.remote()).policy == "weighted_round_robin"
    finally:
        router_actor.kill(app)


def test_a_restarted_router_hears_from_an_idle_replica_at_once(
    served: Served,
) -> None:
    """An idle replica's reports wait for its heartbeat (an hour here): a router
    restarted by Ray learns of it, and it learns that Serve stops it, through
    its ``news`` call pending at the router, which Ray retries on the restarted
    actor."""
    import asyncio
    import contextlib

    import ray

    from cluster.config import RouterConfig
    from deployments.engine.reporter import Reporter

    app, model = "news-test", served.config.model.path
    router = router_actor.get_or_create(RouterConfig(), app, model)
    told: list[bool] = []
    reporter = Reporter(
        "news-r1",
        progress=lambda: (),
        tokens_generated=lambda: 0,
        connect=lambda: router,
        interval_s=0.05,
        heartbeat_s=3600,
        on_draining=told.append,
    )
    stop = threading.Event()

    async def report_until_stopped() -> None:
        task = asyncio.create_task(reporter.run())
        while not stop.is_set():
            await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    thread = threading.Thread(target=asyncio.run, args=(report_until_stopped(),))
    thread.start()

    def known() -> bool:
        return "news-r1" in ray.get(router.snapshot.remote(), timeout=30).replicas

    def incarnation() -> str:
        news = ray.get(router.news.remote("news-r1", "", False, 0), timeout=30)
        return str(news[0])

    try:
        wait_until(known, 30, "the router to learn the replica")
        first = incarnation()
        time.sleep(0.5)  # its news call is pending at the router
        ray.kill(router, no_restart=False)
        wait_until(lambda: incarnation() != first, 30, "the router to restart")
        back = time.monotonic()
        wait_until(known, 5, "the restarted router to learn the idle replica")
        print(f"the idle replica known {time.monotonic() - back:.2f} s after")
        ray.get(router.serving_changed.remote([], ["news-r1"]), timeout=30)
        wait_until(lambda: told == [True], 10, "the idle replica to hear it drains")
    finally:
        stop.set()
        thread.join(30)
        router_actor.kill(app)


def test_router_metrics_reach_prometheus(served: Served) -> None:
    """Admissions and sheds show on Ray's metrics endpoint (exported every ~10 s)."""
    generate(served, [5, 6], 4, pb.REALTIME)
    generate(served, [5, 6], 4, pb.REALTIME, deadline_ms=1)  # shed

    def exported() -> bool:
        admitted = metric_lines(served, "ray_moe_cluster_router_admitted_total")
        shed = metric_lines(served, "ray_moe_cluster_router_shed_total")
        return any('qos="realtime"' in line for line in admitted) and any(
            'qos="realtime"' in line and 'reason="deadline"' in line for line in shed
        )

    wait_until(exported, 60, "router metrics on the Prometheus endpoint")


def test_a_tenant_runs_with_its_own_cache_salt_and_the_same_tokens(
    served: Served,
) -> None:
    def tokens(tenant: str) -> list[int]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=list(range(100, 140))),
            sampling=pb.SamplingParams(max_tokens=8, temperature=0),
            tenant=tenant,
        )
        msgs = list(served.client().generate(request, timeout=60))
        return [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]

    assert tokens("acme") == tokens("") == tokens("globex")
    assert len(tokens("acme")) == 8


def test_engines_measure_the_tokens_each_expert_routes(served: Served) -> None:
    """Every forward token counts once per MoE layer per chosen expert, on the
    replica that ran it; the router's per-group load and the metrics show it."""
    import random

    def windows() -> dict[str, int]:
        groups = router_snapshot(served).groups
        return {g: sum(v.expert_tokens) for g, v in groups.items()}

    window_s = served.config.engine.expert_load_window_s
    wait_until(
        lambda: len(w := windows()) == 2 and not any(w.values()),
        window_s + 5,
        "earlier traffic to leave the expert-load windows",
    )
    prompt = random.Random(1234).sample(range(2, 1000), 130)  # no stored prefix
    result = generate(served, prompt, 8)
    assert result.code == grpc.StatusCode.OK
    # 130 prompt tokens + 7 decode steps, 3 MoE layers, 2 experts a token (per
    # layer 274: over expert_min_window_tokens, so the imbalance is judged too).
    expected = (130 + 7) * 3 * 2
    wait_until(  # the counts of its last steps, reported
        lambda: windows()[result.replica] == expected,
        5,
        f"{expected} routed tokens in the replica's window",
    )
    assert windows() == {r: expected if r == result.replica else 0 for r in windows()}

    def exported() -> bool:
        lines = metric_lines(served, "ray_moe_cluster_expert_load_tokens_per_s")
        imbalance = metric_lines(served, "ray_moe_cluster_expert_imbalance")
        return any(f'group="{result.replica}"' in line for line in lines) and bool(
            imbalance
        )

    wait_until(exported, 60, "expert load metrics on the Prometheus endpoint")
