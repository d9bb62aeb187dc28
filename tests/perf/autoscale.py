"""A load step through the QoS-aware autoscaler: one replica, about twice its
capacity, then idle again; replicas go 1 -> 2 -> 1.

    make bench-autoscale     # or: .venv/bin/python -m tests.perf.autoscale

Closed-loop realtime gRPC streams (a 256-token hot prefix shared by all, a short
unique suffix, 48 output tokens). Phases: ``idle`` (nothing), ``step``
(``2 x router.max_running_per_replica`` streams: half of them wait for a slot
on one replica, so realtime's TTFT SLO is missed and the autoscaler adds a
replica), ``settled`` (the same load on the replicas the step got), ``back``
(one stream, until the autoscaler has stopped the extra replica). Prints
realtime TTFT p50/p99 per phase, the time from the step to the new replica's
first token, that replica's warmup and its first TTFT on the hot prefix against
the old replica's, and the failed requests (goal 0). ``run_step`` is also what
``tests/integration/test_autoscale.py`` drives on the session cluster.

Writes ``tests/perf/results/autoscale.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import ClusterConfig

RESULTS = Path(__file__).parent / "results"
APP = "moe-cluster-autoscale-bench"
PREFIX, SUFFIX, OUTPUT = 256, 8, 48
HOT = [int(t) for t in np.random.default_rng(7).integers(12, 1000, PREFIX)]


def settings(model: str, app: str, slots: int = 4) -> dict[str, Any]:
    """The app: one replica to start, at most two, quick to react (the
    defaults are minutes-scale; these keep a run short)."""
    return {
        "model": {"path": model},
        "engine": {
            "max_model_len": 2048,
            "kv_cache_memory_bytes": 256 << 20,
            "max_num_seqs": 16,
            "omp_num_threads": 1,
            # As `make serve`: no torch.compile at start (on two busy cores it
            # took a starting replica ~50 s).
            "enforce_eager": True,
        },
        "deployment": {
            "num_replicas": 1,
            "num_cpus": 1,
            "drain_timeout_s": 5,
            "autoscaling": {
                "enabled": True,
                "min_replicas": 1,
                "max_replicas": 2,
                "realtime_slo_ttft_ms": 400,
                "upscale_delay_s": 1,
                "downscale_delay_s": 8,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 1.5,
            },
        },
        "router": {
            "max_running_per_replica": slots,
            "realtime_reserved_slots": 0,
            "report_interval_s": 0.25,
            "max_queued": {"realtime": 64, "normal": 64, "background": 64},
        },
        "kvstore": {"capacity_bytes": 256 << 20, "warmup_hot_prefixes": 4},
        "server": {"app_name": app},
    }


@dataclass
class Record:
    phase: str
    sent_at: float
    ttft_s: float | None = None
    replica: str = ""
    cached: int = 0
    error: str = ""


@dataclass
class StepRun:
    t0: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (t, running)
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)

    def failed(self) -> list[Record]:
        return [r for r in self.records if r.error]


def _one(client: Any, phase: str, seq: int, out: StepRun) -> None:
    import grpc

    from deployments.proto import inference_pb2 as pb

    suffix = [12 + (seq * 7 + i * 13) % 980 for i in range(SUFFIX)]
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=HOT + suffix),
        qos=pb.REALTIME,
        sampling=pb.SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True),
    )
    rec = Record(phase, time.monotonic())
    try:
        for msg in client.generate(request, timeout=120):
            if msg.HasField("chunk") and rec.ttft_s is None:
                rec.ttft_s = time.monotonic() - rec.sent_at
            elif msg.HasField("finished"):
                rec.replica = msg.finished.replica_id
                rec.cached = msg.finished.cached_tokens
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    out.records.append(rec)


def engine_replicas(app: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "Engine" not in status.deployments:
        return 0
    counts = status.deployments["Engine"].replica_states
    return int(counts.get("RUNNING", 0))


def run_step(
    client: Any,
    app: str,
    streams: int,
    *,
    settle_s: float = 10.0,
    limit_s: float = 180.0,
    start_replicas: int = 1,
    log: Callable[[str], None] = print,
) -> StepRun:
    """Drives the four phases; each ends on its condition or at ``limit_s``.
    ``start_replicas``: the Serve replicas serving at the start (an EP group's
    ranks each serve)."""
    run = StepRun()
    t0 = run.t0
    stop = threading.Event()
    phase = ["idle"]
    wanted = [0]
    seq = [0]
    lock = threading.Lock()

    def worker(i: int) -> None:
        while not stop.is_set():
            if i >= wanted[0]:
                time.sleep(0.05)
                continue
            with lock:
                seq[0] += 1
                n = seq[0]
            _one(client, phase[0], n, run)

    def watch() -> None:
        while not stop.is_set():
            run.replicas.append((time.monotonic() - t0, engine_replicas(app)))
            time.sleep(0.25)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()

    def phase_until(name: str, n: int, done: Callable[[], bool], limit: float) -> None:
        start = time.monotonic()
        phase[0], wanted[0] = name, n
        while not done() and time.monotonic() - start < limit:
            time.sleep(0.1)
        run.phases[name] = (start - t0, time.monotonic() - t0)
        log(f"phase {name}: {time.monotonic() - start:.1f} s")

    def new_replica_served() -> bool:
        served = {r.replica for r in run.records if r.replica}
        return len(served) > start_replicas

    try:
        phase_until("idle", 0, lambda: False, 2.0)
        phase_until("step", streams, new_replica_served, limit_s)
        phase_until("settled", streams, lambda: False, settle_s)
        phase_until("back", 1, lambda: engine_replicas(app) == start_replicas, limit_s)
        run.replicas.append((time.monotonic() - t0, engine_replicas(app)))
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    return run


def summary(run: StepRun, start_replicas: int = 1) -> dict[str, Any]:
    """Per-phase realtime TTFT, the time from the step to the new replica's
    first token, and the first TTFTs of the old and the new replica."""
    out: dict[str, Any] = {"phases": {}, "failed": len(run.failed())}
    for name, (start, end) in run.phases.items():
        ttfts = sorted(r.ttft_s for r in run.records if r.phase == name and r.ttft_s)
        out["phases"][name] = {
            "seconds": round(end - start, 1),
            "requests": len(ttfts),
            "ttft_ms_p50": round(statistics.median(ttfts) * 1e3) if ttfts else None,
            "ttft_ms_p99": (
                round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3)
                if ttfts
                else None
            ),
        }
    step_at = run.t0 + run.phases["step"][0]
    ordered = sorted(
        (r for r in run.records if r.ttft_s is not None),
        key=lambda r: r.sent_at + (r.ttft_s or 0),
    )
    first_by: dict[str, Record] = {}
    for r in ordered:
        if r.replica:
            first_by.setdefault(r.replica, r)
    firsts = list(first_by.values())
    if len(firsts) > start_replicas:
        old, n = firsts[0], firsts[start_replicas]
        out["step_to_new_replica_s"] = round(n.sent_at + (n.ttft_s or 0) - step_at, 2)
        first_ms = round((n.ttft_s or 0) * 1e3)
        out["new_replica_first"] = {"ttft_ms": first_ms, "cached": n.cached}
        # The old replica's requests sent about then (a warm engine).
        near = [
            r
            for r in ordered
            if r.replica == old.replica and abs(r.sent_at - n.sent_at) < 2
        ]
        if near:
            out["old_replica_same_time"] = {
                "ttft_ms_p50": round(
                    statistics.median(r.ttft_s or 0 for r in near) * 1e3
                ),
                "cached_p50": statistics.median(r.cached for r in near),
            }
    out["replicas_max"] = max((n for _, n in run.replicas), default=0)
    out["replicas_end"] = run.replicas[-1][1] if run.replicas else 0
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settle-s", type=float, default=20.0)
    args = parser.parse_args()

    import ray
    from ray import serve

    from deployments.app import deploy, prepare_model
    from deployments.ingress.client import InferenceClient

    model = str(Path(".models/tiny-deepseek-v2").resolve())
    s = settings(model, APP)
    s["server"] |= {"http_port": 18153, "grpc_port": 18154}
    config = prepare_model(ClusterConfig.model_validate(s))
    ray.init(num_cpus=4, include_dashboard=False, namespace="moe-cluster-bench")
    try:
        deploy(config)
        client = InferenceClient(f"127.0.0.1:{config.server.grpc_port}", "", APP)
        _one(client, "first", 0, StepRun())  # first-call costs out of the way
        slots = config.router.max_running_per_replica
        run = run_step(client, APP, 2 * slots, settle_s=args.settle_s)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = summary(run)
    result["replica_timeline"] = run.replicas[:: max(1, len(run.replicas) // 200)]
    result["records"] = [asdict(r) for r in run.records]
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=2))
    lines = [
        "| phase | seconds | requests | realtime TTFT p50 (ms) | p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, p in result["phases"].items():
        lines.append(
            f"| {name} | {p['seconds']} | {p['requests']} | {p['ttft_ms_p50']} "
            f"| {p['ttft_ms_p99']} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "autoscale.json").write_text(json.dumps(result, indent=2))
    keys = (
        "step_to_new_replica_s",
        "new_replica_first",
        "old_replica_same_time",
        "failed",
        "replicas_max",
        "replicas_end",
    )
    extra = {k: result.get(k) for k in keys}
    (RESULTS / "autoscale.md").write_text(
        "Written by `python -m tests.perf.autoscale` (2-core machine): "
        f"{2 * slots} closed-loop realtime streams against one replica of "
        f"{slots} router slots, then one; replicas 1 -> 2 -> 1.\n\n"
        + table
        + "\n\n```\n"
        + json.dumps(extra, indent=2)
        + "\n```\n"
    )


if __name__ == "__main__":
    main()
