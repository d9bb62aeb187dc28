"""What the shared page store buys: prefix reuse across replicas, and warm starts.

    .venv/bin/python -m tests.perf.kv_reuse [--trials 8]

Two engine replicas of the tiny model (one core each) on one node. TTFT is measured
at the engine deployment (request sent to a chosen replica through Serve, first
token back), so it excludes the ingress and is the same for gRPC and HTTP clients.

1. Second-replica TTFT: a 512-token prefix is computed on replica A; then replica B
   serves the prefix + a 16-token suffix. With the store, B loads the prefix's 32
   pages; without it (``kvstore.enabled: false``), B recomputes them.
2. New-replica TTFT: a 512-token prefix is made hot (served from the store several
   times); then one replica's engine is killed and Serve starts a replacement.
   The replacement's first request is that prefix + a suffix (``--restarts`` times,
   a new hot prefix each time), with warmup on
   (``warmup_hot_prefixes: 8``: it runs the hot prefixes before taking traffic) and
   off (0), and without the store at all.

Writes ``tests/perf/results/kv_reuse.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

from cluster.config import ClusterConfig
from tests.integration.test_kvstore import generate, unique_prompt

RESULTS = Path(__file__).parent / "results"
APP = "moe-cluster-kv-bench"


def _config(model: str, store: bool, warmup: int) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "model": {"path": model},
            "engine": {
                "max_model_len": 1024,
                "kv_cache_memory_bytes": 128 << 20,
                "max_num_seqs": 16,
                "enforce_eager": True,
                "omp_num_threads": 1,
            },
            "deployment": {"num_replicas": 2, "num_cpus": 1},
            "kvstore": {
                "enabled": store,
                "capacity_bytes": 256 << 20,
                "warmup_hot_prefixes": warmup,
            },
            "server": {"app_name": APP, "http_port": 18123, "grpc_port": 18124},
        }
    )


def _replicas(handle: Any) -> dict[str, Any]:
    from tests.integration.conftest import engine_stats

    found: dict[str, Any] = engine_stats(handle)
    return found


def _two(handle: Any) -> list[str]:
    for _ in range(100):
        r = _replicas(handle)
        if len(r) == 2:
            return sorted(r)
        time.sleep(1)
    raise RuntimeError("two replicas never answered")


def second_replica(handle: Any, trials: int) -> list[float]:
    a, b = _two(handle)
    out = []
    for _ in range(trials):
        prefix = unique_prompt(512)
        generate(handle, a, [*prefix, 1])
        run = generate(handle, b, prefix + unique_prompt(16))
        out.append(run.ttft_s * 1000)
    return out


def new_replica(handle: Any) -> tuple[float, int, float]:
    """(first-request TTFT ms, its cached tokens, seconds until it answered)."""
    a, b = _two(handle)
    hot = unique_prompt(512)  # a new hot prefix each time
    for replica in (a, b, a, b):
        generate(handle, replica, [*hot, 1])
    time.sleep(1.5)  # the stores' hot lists reach the directory
    victim = _replicas(handle)[b]
    for child in psutil.Process(victim.pid).children(recursive=True):
        child.kill()
    killed = time.monotonic()
    while True:
        now = _replicas(handle)
        fresh = [r for r in now if r not in (a, b)]
        if fresh:
            break
        time.sleep(0.2)
    back = time.monotonic() - killed
    run = generate(handle, fresh[0], hot + unique_prompt(16))
    return run.ttft_s * 1000, run.finish.cached_tokens, back


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--restarts", type=int, default=3)
    args = parser.parse_args()

    import ray
    from ray import serve

    from deployments.app import deploy, prepare_model
    from kvstore import actor as kv_actor

    model = str(Path(".models/tiny-deepseek-v2").resolve())
    ray.init(num_cpus=2, include_dashboard=False, namespace="moe-cluster-bench")
    results: dict[str, Any] = {}
    try:
        for mode, store, warmup in (
            ("store, warmup", True, 8),
            ("store, no warmup", True, 0),
            ("no store", False, 0),
        ):
            config = prepare_model(_config(model, store, warmup))
            deploy(config)
            handle = serve.get_deployment_handle("Engine", APP)
            second = second_replica(handle, args.trials) if warmup == 0 else []
            restarts = [new_replica(handle) for _ in range(args.restarts)]
            results[mode] = {
                "second_replica_ttft_ms": second,
                "new_replica_first_ttft_ms": [r[0] for r in restarts],
                "new_replica_cached_tokens": [r[1] for r in restarts],
                "replacement_answered_s": [r[2] for r in restarts],
            }
            print(mode, results[mode], flush=True)
            serve.delete(APP)
            kv_actor.kill(APP)
    finally:
        serve.shutdown()
        ray.shutdown()

    lines = [
        "| mode | 2nd-replica TTFT p50 (ms) | min | max | new replica's 1st TTFT "
        "(ms, each restart) | its cached tokens | replacement answered after (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        s = r["second_replica_ttft_ms"]
        cells = (
            [f"{statistics.median(s):.1f}", f"{min(s):.1f}", f"{max(s):.1f}"]
            if s
            else ["-", "-", "-"]
        )
        firsts = ", ".join(f"{x:.1f}" for x in r["new_replica_first_ttft_ms"])
        cached = ", ".join(str(x) for x in r["new_replica_cached_tokens"])
        back = ", ".join(f"{x:.1f}" for x in r["replacement_answered_s"])
        lines.append(f"| {mode} | {' | '.join(cells)} | {firsts} | {cached} | {back} |")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_reuse.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "kv_reuse.md").write_text(
        "Written by `python -m tests.perf.kv_reuse` (2-core machine).\n\n"
        + table
        + "\n"
    )


if __name__ == "__main__":
    main()
