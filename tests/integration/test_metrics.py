"""What Ray's Prometheus endpoint carries for an operator: vLLM's engine metrics
under vLLM's own names, recorded in each engine replica (as Ray Serve LLM records
them, so its Grafana dashboard works), and the cluster's own."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import httpx

from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import (
    PLATFORM,
    Served,
    engine_stats,
    metric_lines,
    wait_until,
)
from tests.integration.test_kvstore import generate, unique_prompt

# vLLM's names, as Ray re-exports them (ray_ prefix, ':' made '_').
ENGINE_METRICS = [
    "ray_vllm_time_to_first_token_seconds_bucket",
    "ray_vllm_inter_token_latency_seconds_bucket",
    "ray_vllm_e2e_request_latency_seconds_bucket",
    "ray_vllm_request_queue_time_seconds_bucket",
    "ray_vllm_request_prefill_time_seconds_bucket",
    "ray_vllm_request_decode_time_seconds_bucket",
    "ray_vllm_num_requests_running",
    "ray_vllm_num_requests_waiting",
    "ray_vllm_kv_cache_usage_perc",
    "ray_vllm_prefix_cache_queries_total",
    "ray_vllm_prefix_cache_hits_total",
    # Per request (the counter vllm:num_preemptions appears at the first one).
    "ray_vllm_request_num_preemptions_bucket",
    "ray_vllm_prompt_tokens_total",
    "ray_vllm_generation_tokens_total",
    "ray_vllm_request_success_total",
]
# vLLM's own prefix cache is off on the reference CPU_MLA backend: its counters
# are never incremented there, and Ray exports a counter only once it has been.
NOT_ON_CPU_MLA = {
    "ray_vllm_prefix_cache_queries_total",
    "ray_vllm_prefix_cache_hits_total",
}
ON_CPU_MLA = PLATFORM.backend.value == "CPU_MLA"


def expected(names: list[str]) -> list[str]:
    return [n for n in names if not (ON_CPU_MLA and n in NOT_ON_CPU_MLA)]


CLUSTER_METRICS = [
    "ray_moe_cluster_ttft_seconds_bucket",
    "ray_moe_cluster_router_queue_wait_seconds_bucket",
    "ray_moe_cluster_requests_total",
    "ray_gen_ai_server_time_to_first_token_seconds_bucket",
    "ray_gen_ai_server_time_per_output_token_seconds_bucket",
    "ray_gen_ai_server_request_duration_seconds_bucket",
    "ray_moe_cluster_router_replica_breaker",
    "ray_moe_cluster_router_group_breaker",
    "ray_moe_cluster_kv_hit_pages_total",
    "ray_moe_cluster_kv_hit_bytes_total",
]


def exported(missing: Callable[[], list[str]]) -> None:
    """Waits until ``missing()`` is empty (Ray exports every few seconds)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not missing(), timeout=90, what="the metrics")
    assert missing() == []


def some_traffic(served: Served, engine_handle: Any) -> None:
    """Requests of every class over both protocols, and a prompt computed on one
    replica and then loaded from the page store by the other."""
    a, b = sorted(engine_stats(engine_handle))
    # Over the router's expert_min_window_tokens (256) on any block size, so the
    # replica that computes it has a layer imbalance to report.
    prompt = unique_prompt(max(3 * PLATFORM.block_size + 1, 300))
    generate(engine_handle, a, prompt)
    generate(engine_handle, b, prompt)
    client = served.client()
    try:
        for qos in (pb.REALTIME, pb.NORMAL, pb.BACKGROUND):
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(5, 5 + 3 * 64))),
                sampling=pb.SamplingParams(max_tokens=4, temperature=0),
                qos=qos,
            )
            list(client.generate(request, timeout=120))
    finally:
        client.close()
    r = httpx.post(
        f"{served.http_base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {served.api_key}"},
        json={
            "model": "tiny-deepseek-v2",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_engine_metrics_are_vllms_own_recorded_in_each_replica(
    served: Served, engine_handle: Any
) -> None:
    some_traffic(served, engine_handle)

    def missing() -> list[str]:
        return [m for m in expected(ENGINE_METRICS) if not metric_lines(served, m)]

    exported(missing)
    for line in metric_lines(served, "ray_vllm_time_to_first_token_seconds_count"):
        # The labels Ray Serve LLM's dashboard filters and joins on.
        assert 'model_name="tiny-deepseek-v2"' in line
        assert "ReplicaId=" in line and "WorkerId=" in line
    replicas = {
        line.split('ReplicaId="')[1].split('"')[0]
        for line in metric_lines(served, "ray_vllm_time_to_first_token_seconds_count")
    }
    assert len(replicas) >= 2  # one series per engine replica


def test_the_clusters_own_metrics_are_exported(
    served: Served, engine_handle: Any
) -> None:
    some_traffic(served, engine_handle)

    def missing() -> list[str]:
        return [m for m in expected(CLUSTER_METRICS) if not metric_lines(served, m)]

    exported(missing)
    ttft = metric_lines(served, "ray_moe_cluster_ttft_seconds_count")
    assert {
        q
        for q in ("realtime", "normal", "background")
        if any(f'qos="{q}"' in line for line in ttft)
    } == {"realtime", "normal", "background"}
    genai = metric_lines(served, "ray_gen_ai_server_time_to_first_token_seconds_count")
    assert any('gen_ai_operation_name="chat"' in line for line in genai)
    assert any('gen_ai_operation_name="text_completion"' in line for line in genai)


def _samples(served: Served, name: str) -> dict[str, float]:
    """Each replica's value of the gauge ``name``."""
    return {
        line.split('ReplicaId="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metric_lines(served, name)
    }


def test_idle_engines_keep_their_scheduler_gauges(
    served: Served, engine_handle: Any
) -> None:
    """vLLM sets its scheduler gauges only on an engine step; Ray drops a gauge
    not set for two export intervals (after the worker's last export of it). An
    idle engine still reads 0 past that."""
    import ray

    some_traffic(served, engine_handle)
    wait_until(
        lambda: all(s.running == 0 for s in engine_stats(engine_handle).values()),
        60,
        "idle engines",
    )
    lifetime_s = 2 * max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    time.sleep(2 * lifetime_s + 5)
    for name in (
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
    ):
        values = _samples(served, name)
        assert len(values) >= 2, (name, values)  # every replica, still there
        assert set(values.values()) == {0.0}, (name, values)


def _engine_requests(served: Served) -> dict[str, float]:
    """Serve's count of the engine deployment's requests by route, of those the
    ingress sends for its clients (not its own calls, which carry no route)."""
    counts: dict[str, float] = {}
    for line in metric_lines(served, "ray_serve_deployment_request_counter_total"):
        if 'deployment="Engine"' not in line or 'route="' not in line:
            continue
        route = line.split('route="')[1].split('"')[0]
        if route:
            counts[route] = counts.get(route, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _settled(served: Served) -> dict[str, float]:
    """``_engine_requests`` once an export interval has passed without change."""
    import ray

    interval_s = max(ray._config.metrics_report_interval_ms(), 1000) / 1000 + 1
    last = _engine_requests(served)
    seen = [last]  # every reading, for the message if they never settle
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        now = _engine_requests(served)
        if now == last:
            return now
        last = now
        seen.append(now)
    raise AssertionError(f"Serve's request counts never settled: {seen}")


def test_serve_counts_each_request_once_direct_or_not(served: Served) -> None:
    """The ingress streams from an engine replica past Serve's handle once it
    knows the replica's endpoint (the first requests placed there go through
    Serve). Serve's request series for the engine deployment (the Ray
    dashboard's Serve views) count every request once all the same, under the
    route the ingress's request had."""
    before = _settled(served)
    rounds = 8
    client = served.client()
    try:
        for _ in range(rounds):
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(7, 7 + 40))),
                sampling=pb.SamplingParams(max_tokens=2, temperature=0),
            )
            list(client.generate(request, timeout=120))
            r = httpx.post(
                f"{served.http_base}/v1/completions",
                headers={"Authorization": f"Bearer {served.api_key}"},
                json={
                    "model": "tiny-deepseek-v2",
                    "prompt": [5, 6, 7],
                    "max_tokens": 2,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
    finally:
        client.close()

    def added() -> dict[str, float]:
        now = _engine_requests(served)
        return {
            r: now[r] - before.get(r, 0.0) for r in now if now[r] > before.get(r, 0.0)
        }

    with contextlib.suppress(AssertionError):
        wait_until(lambda: sum(added().values()) >= 2 * rounds, 90, "the requests")
    assert sum(added().values()) >= 2 * rounds, (before, _engine_requests(served))
    _settled(served)
    # One route for gRPC's requests (the application's), one for HTTP's.
    assert sorted(added().values()) == [rounds, rounds], added()
    assert "/v1/completions" in added(), added()
