"""The engine replica's stat logger against vLLM's own, step by step.

Both loggers record the same engine steps; every call they make to Ray's
metrics API is captured. The engine replica's must leave every series where
vLLM's leaves it (each gauge's last value, each counter's total, each
histogram's observations) in fewer calls, and keep its gauges alive.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from ray.util import metrics as ray_metrics

from cluster.config import ClusterConfig
from deployments.engine.args import engine_args

Call = tuple[str, str, tuple[tuple[str, str], ...], float]


@pytest.fixture(scope="module")
def vllm_config(tiny_model: Path) -> Any:
    """The tiny model's engine config, with the page store's connector (its KV
    fetch gauges are among those set on every step)."""
    config = ClusterConfig.model_validate({"model": {"path": str(tiny_model)}})
    engine = config.resolved().engine
    args = engine_args(str(tiny_model), "tiny", engine, kv_store_socket="/unused")
    return args.create_engine_config()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Every value recorded through Ray's metrics: (kind, name, tags, value)."""
    seen: list[Call] = []

    def record(metric: Any, value: float, tags: dict[str, str] | None = None) -> None:
        kind = type(metric).__name__
        seen.append((kind, metric._name, tuple(sorted((tags or {}).items())), value))

    monkeypatch.setattr(ray_metrics.Metric, "_record", record)
    return seen


def steps() -> list[tuple[Any, Any]]:
    """A request's prefill with a hit, its decode steps, a second request's
    arrival, waiting and a finish: (scheduler stats, iteration stats) each."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.stats import (
        FinishedRequestStats,
        IterationStats,
        PrefixCacheStats,
        SchedulerStats,
    )

    out = []
    for i in range(40):
        s = SchedulerStats(
            num_running_reqs=1 if i < 20 else 2,
            num_waiting_reqs=1 if 18 <= i < 20 else 0,
            num_kv_fetch_reqs_by_stage={"in_progress": 1} if i == 19 else {},
            kv_cache_usage=0.01 * (1 + i // 8),
            prefix_cache_stats=PrefixCacheStats(
                requests=1 if i in (0, 20) else 0,
                queries=256 if i in (0, 20) else 0,
                hits=128 if i == 20 else 0,
            ),
            connector_prefix_cache_stats=PrefixCacheStats(
                requests=1 if i in (0, 20) else 0,
                queries=128 if i in (0, 20) else 0,
                hits=64 if i == 20 else 0,
                hits_by_source={CacheHitSource.HOST: 64} if i == 20 else {},
            ),
        )
        it = IterationStats()
        it.num_generation_tokens = 1 if i < 20 else 2
        if i in (0, 20):
            p = it.prompt_token_stats
            p.total, p.local_cache_hit = 256, 128 if i else 0
            p.external_kv_transfer = 64 if i else 0
            p.cached_tokens = p.local_cache_hit + p.external_kv_transfer
            p.computed = p.total - p.cached_tokens
            it.time_to_first_tokens_iter.append(0.02)
        else:
            it.inter_token_latencies_iter.append(0.004 + 0.0001 * i)
        if i == 39:
            it.finished_requests.append(
                FinishedRequestStats(
                    finish_reason=FinishReason.LENGTH,
                    e2e_latency=0.3,
                    num_prompt_tokens=256,
                    num_generation_tokens=40,
                    max_tokens_param=40,
                    queued_time=0.001,
                    prefill_time=0.02,
                    inference_time=0.29,
                    decode_time=0.27,
                    mean_time_per_output_token=0.004,
                )
            )
        out.append((s, it))
    return out


def run(logger: Any, calls: list[Call]) -> list[Call]:
    del calls[:]
    for scheduler_stats, iteration_stats in steps():
        logger.record(scheduler_stats, iteration_stats)
    return list(calls)


def series(recorded: list[Call]) -> dict[str, dict[Any, Any]]:
    """Where each series ends: gauges' last value, counters' total, histograms'
    observations (as a multiset)."""
    ends: dict[str, dict[Any, Any]] = defaultdict(dict)
    for kind, name, tags, value in recorded:
        key = (name, tags)
        if kind == "Gauge":
            ends[kind][key] = value
        elif kind == "Counter":
            ends[kind][key] = ends[kind].get(key, 0) + value
        else:
            ends[kind].setdefault(key, Counter())[value] += 1
    return ends


def test_every_series_ends_where_vllms_does_in_fewer_calls(
    vllm_config: Any, calls: list[Call]
) -> None:
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    from deployments.engine.stat_logger import EngineStatLogger

    theirs = run(RayPrometheusStatLogger(vllm_config), calls)
    ours = run(EngineStatLogger(vllm_config), calls)
    assert series(ours) == series(theirs)
    assert {"Gauge", "Counter", "Histogram"} <= set(series(ours))
    gauge_calls = Counter(kind for kind, *_ in ours)["Gauge"]
    their_gauge_calls = Counter(kind for kind, *_ in theirs)["Gauge"]
    # vLLM sets all eight gauges on each of the 40 steps; ours, their first
    # values and then only the changes.
    assert their_gauge_calls == 8 * 40
    assert gauge_calls < their_gauge_calls / 5
    assert len(ours) < len(theirs) / 2


def test_a_gauge_is_passed_on_when_it_changes(
    vllm_config: Any, calls: list[Call]
) -> None:
    from deployments.engine.stat_logger import EngineStatLogger

    ours = run(EngineStatLogger(vllm_config), calls)
    running = [v for _, name, _, v in ours if name == "vllm_num_requests_running"]
    usage = [v for _, name, _, v in ours if name == "vllm_kv_cache_usage_perc"]
    assert running == [1, 2]
    assert usage == [0.01 * (1 + i) for i in range(5)]


def test_refresh_sets_every_gauge_again(vllm_config: Any, calls: list[Call]) -> None:
    """Ray drops a gauge not set for two export intervals: ``refresh`` (every
    second) sets each again, unchanged or, with the engine idle, to 0."""
    from deployments.engine.stat_logger import EngineStatLogger

    logger = EngineStatLogger(vllm_config)
    ends = series(run(logger, calls))["Gauge"]
    del calls[:]
    logger.refresh(idle=False)
    assert series(calls)["Gauge"] == ends
    assert len(calls) == len(ends) == 8
    del calls[:]
    logger.refresh(idle=True)
    assert {v for *_, v in calls} == {0} and len(calls) == 8
    del calls[:]
    logger.refresh(idle=True)  # an idle engine's gauges are kept alive too
    assert {v for *_, v in calls} == {0} and len(calls) == 8
    # and the next step sets what it changes again
    del calls[:]
    s, it = steps()[5]
    logger.record(s, it)
    gauges = {name: v for kind, name, _, v in calls if kind == "Gauge"}
    assert gauges == {"vllm_num_requests_running": 1, "vllm_kv_cache_usage_perc": 0.01}
