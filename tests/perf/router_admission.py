"""Admissions per second one DeepSeekRouter actor sustains.

    .venv/bin/python -m tests.perf.router_admission [--procs 1,4,16]
        [--replicas 16] [--slots 64] [--concurrency 16] [--seconds 20]
        [--ray-calls]

The router runs as in a deployment (its named, detached actor). Synthetic engine
replicas report to it every ``router.report_interval_s``. Each ingress process (a
Ray actor, as an ingress replica is) runs a closed loop of ``--concurrency``
requests through the ingress's own ``RouterClient``: admit (a 256-token prompt's
block hashes and an expert histogram, as the ingress sends), then release at
once; the batches go on the router's admission socket (``router.wire``), or as
Ray actor calls with ``--ray-calls``. Prints, per number of ingress processes:
admissions/s, and the admit round trip at the ingress, p50 and p99, and the
p99 of the run's first and last thirds (a router whose cost grows with what it
has served shows there).

Then the model of the bound, for ``--model-replicas`` x ``--slots`` (default 100 x
64) and for the measured cluster: one router is one event loop, so it sustains
``B / (call + B * admission)`` admissions/s at ``B`` admissions per batched call,
where ``call`` is the router's time per call whatever it carries (measured here,
on the same transport: empty ``admit_many`` calls/s from 4 processes at once, an
upper bound as the callers share the cores) and ``admission`` its compute per
admission and release (measured in-process: the actor's own ``admit_many`` and
``release_many``, with half the slots busy).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import ray

from cluster.actors import NAMESPACE
from cluster.config import RouterConfig
from cluster.qos import QoS
from cluster.tiny_model import write_tiny_model
from kvstore.block_hash import block_hashes
from router import actor as router_actor
from router.types import Outcome, Release, ReplicaId, ReplicaReport, Ticket

RESULTS = Path(__file__).parent / "results"
MODEL_DIR = Path(".models/tiny-deepseek-v2")
APP = "admission-bench"
EXPERTS = 16


def router_config(slots: int) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "policy": "prefix",
            "max_running_per_replica": slots,
            "realtime_reserved_slots": 0,
            "max_queued": {"realtime": 10**6, "normal": 10**6, "background": 10**6},
        }
    )


@ray.remote(num_cpus=0)
class Reporters:
    """Every synthetic replica's report, each ``interval_s``."""

    def __init__(self, replicas: int, interval_s: float) -> None:
        self._replicas = replicas
        self._interval_s = interval_s

    async def run(self, until: float) -> None:
        router = ray.get_actor(router_actor.actor_name(APP), namespace=NAMESPACE)
        while time.time() < until:
            await asyncio.gather(
                *(
                    router.report.remote(ReplicaReport(ReplicaId(f"r{i}")))
                    for i in range(self._replicas)
                )
            )
            await asyncio.sleep(self._interval_s)


def ticket_shapes(seed: int) -> list[Ticket]:
    """64 tickets as the ingress makes them (a 256-token prompt's block hashes
    and an expert histogram, the three classes in turn), to copy."""
    rng = random.Random(seed)
    shapes = []
    for k in range(64):
        prompt = [rng.randrange(1000) for _ in range(256)]
        hist = tuple(rng.randrange(40) for _ in range(EXPERTS))
        hashes = block_hashes(prompt, 16)
        shapes.append(Ticket(f"{seed}-{k}", QoS(k % 3), 256, 64, None, hashes, hist))
    return shapes


@ray.remote(num_cpus=0)
class IngressLoad:
    """One ingress process: ``concurrency`` closed loops of admit + release."""

    def __init__(self, index: int, ray_calls: bool) -> None:
        from deployments.ingress.router_client import RouterClient

        self._tickets = ticket_shapes(index)
        self._client = RouterClient(
            lambda: ray.get_actor(router_actor.actor_name(APP), namespace=NAMESPACE),
            None,  # type: ignore[arg-type]  # tickets are made here
            socket=not ray_calls,
        )
        self._index = index

    async def run(
        self, concurrency: int, start: float, seconds: float
    ) -> list[tuple[float, float]]:
        """(when it completed, its round trip) of each admit completed inside
        [start, start + seconds), in seconds."""
        await asyncio.sleep(max(0.0, start - time.time()))
        end = start + seconds
        done: list[tuple[float, float]] = []
        n = 0

        async def loop(worker: int) -> None:
            nonlocal n
            while time.time() < end:
                base = self._tickets[(worker + n) % len(self._tickets)]
                n += 1
                rid = f"{self._index}-{worker}-{n}"
                ticket = Ticket(
                    rid,
                    base.qos,
                    base.prompt_tokens,
                    base.max_tokens,
                    None,
                    base.block_hashes,
                    base.expert_hist,
                )
                t0 = time.perf_counter()
                decision = await self._client.admit(ticket)
                done.append((time.time(), time.perf_counter() - t0))
                self._client.release(Release(rid, Outcome.OK, decision.replica_id))

        await asyncio.gather(*(loop(w) for w in range(concurrency)))
        return done


@ray.remote(num_cpus=0)
class EmptyCalls:
    """Calls the router with empty batches, 16 at a time, back to back, on the
    admission socket as the ingress does (through Ray with ``ray_calls``)."""

    async def run(self, start: float, seconds: float, ray_calls: bool) -> int:
        from router.wire import AdmissionLink

        router = ray.get_actor(router_actor.actor_name(APP), namespace=NAMESPACE)
        link = AdmissionLink(router.admission_endpoint.remote)
        await asyncio.sleep(max(0.0, start - time.time()))
        calls = 0

        async def loop() -> None:
            nonlocal calls
            while time.time() < start + seconds:
                if ray_calls:
                    await router.admit_many.remote([])
                else:
                    await link.admit_many([])
                calls += 1

        await asyncio.gather(*(loop() for _ in range(16)))
        return calls


def call_cost_s(ray_calls: bool, procs: int = 4, seconds: float = 4.0) -> float:
    """The router's time per call: empty calls/s at saturation, inverted."""
    callers = [EmptyCalls.remote() for _ in range(procs)]  # type: ignore[attr-defined]
    ray.get([c.__ray_ready__.remote() for c in callers])
    start = time.time() + 0.5
    runs = [c.run.remote(start, seconds, ray_calls) for c in callers]
    calls: int = sum(ray.get(runs))
    for c in callers:
        ray.kill(c)
    return seconds / calls


def admission_cost_s(replicas: int, slots: int, rounds: int = 400) -> float:
    """The router's compute per admission and release, in-process: batches of
    16 admitted and the oldest 16 released, half of every replica's slots busy."""
    router = router_actor.DeepSeekRouter(
        router_config(slots).model_copy(update={"replica_stale_s": 1e9}), EXPERTS
    )
    shapes = ticket_shapes(0)
    made = 0

    def batch() -> list[Ticket]:
        nonlocal made
        out = []
        for _ in range(16):
            shape = shapes[made % len(shapes)]
            made += 1
            out.append(dataclasses.replace(shape, request_id=f"t{made}"))
        return out

    async def run() -> float:
        for i in range(replicas):
            await router.report(ReplicaReport(ReplicaId(f"r{i}")))
        running: list[tuple[Ticket, Any]] = []
        while len(running) < replicas * slots // 2:
            tickets = batch()
            running += zip(tickets, await router.admit_many(tickets), strict=True)
        t0 = time.perf_counter()
        for _ in range(rounds):
            tickets = batch()
            running += zip(tickets, await router.admit_many(tickets), strict=True)
            done, running = running[:16], running[16:]
            await router.release_many(
                [Release(t.request_id, Outcome.OK, d.replica_id) for t, d in done]
            )
        return (time.perf_counter() - t0) / (rounds * 16)

    return asyncio.run(run())


def model(call_s: float, admission_s: float) -> dict[str, float]:
    """Admissions/s one router sustains at batches of 1, 16 and 64."""
    return {f"batch_{b}": b / (call_s + b * admission_s) for b in (1, 16, 64)}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def measure(
    procs: int, concurrency: int, seconds: float, ray_calls: bool
) -> dict[str, Any]:
    loads = [IngressLoad.remote(i, ray_calls) for i in range(procs)]  # type: ignore[attr-defined]
    ray.get([load.__ray_ready__.remote() for load in loads])
    start = time.time() + 1.0
    warm = ray.get([load.run.remote(concurrency, start, 1.0) for load in loads])
    del warm
    start = time.time() + 0.5
    runs = ray.get([load.run.remote(concurrency, start, seconds) for load in loads])
    for load in loads:
        ray.kill(load)
    done = [x for run in runs for x in run]
    latencies = [x for _, x in done]
    # A router whose cost grows with what it has served shows as a tail that
    # grows over the run: the first and last thirds' p99 apart.
    first = [x for at, x in done if at < start + seconds / 3]
    last = [x for at, x in done if at >= start + 2 * seconds / 3]
    return {
        "ingress_processes": procs,
        "concurrency_per_process": concurrency,
        "admissions_per_s": len(latencies) / seconds,
        "p50_ms": 1e3 * percentile(latencies, 0.5),
        "p99_ms": 1e3 * percentile(latencies, 0.99),
        "p99_first_third_ms": 1e3 * percentile(first, 0.99),
        "p99_last_third_ms": 1e3 * percentile(last, 0.99),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", default="1,4,16")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    # Longer than the router remembers released requests (10 s), so that the
    # last third runs with that memory full.
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--model-replicas", type=int, default=100)
    p.add_argument(
        "--ray-calls",
        action="store_true",
        help="admissions as Ray actor calls (router.admission_socket off)",
    )
    p.add_argument("--label", default="")
    args = p.parse_args()
    if not (MODEL_DIR / "config.json").exists():
        write_tiny_model(MODEL_DIR)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = router_config(args.slots)
    router = router_actor.get_or_create(config, APP, str(MODEL_DIR), replace=True)
    ray.get(router.ready.remote())
    total_s = 3 + len(args.procs.split(",")) * (args.seconds + 8)
    reporters = Reporters.remote(args.replicas, config.report_interval_s)  # type: ignore[attr-defined]
    reporting = reporters.run.remote(time.time() + total_s)
    time.sleep(2)  # every replica has reported
    rows = []
    try:
        for procs in (int(x) for x in args.procs.split(",")):
            row = measure(procs, args.concurrency, args.seconds, args.ray_calls)
            rows.append(row)
            print(
                f"{procs:3d} ingress x {args.concurrency} in flight: "
                f"{row['admissions_per_s']:7.0f} admissions/s, admit round trip "
                f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms "
                f"(first third {row['p99_first_third_ms']:.2f}, last "
                f"{row['p99_last_third_ms']:.2f})",
                flush=True,
            )
        call_s = call_cost_s(args.ray_calls)
    finally:
        ray.cancel(reporting)
        router_actor.kill(APP)
        ray.shutdown()
    bound: dict[str, Any] = {"router_s_per_call": call_s}
    for n in (args.replicas, args.model_replicas):
        admission_s = admission_cost_s(n, args.slots)
        bound[f"{n}x{args.slots}"] = {"router_s_per_admission": admission_s} | model(
            call_s, admission_s
        )
        rates = ", ".join(
            f"{v:,.0f}/s at {k.split('_')[1]}"
            for k, v in model(call_s, admission_s).items()
        )
        print(
            f"model, {n} replicas x {args.slots} slots: {call_s * 1e6:.0f} us per "
            f"call + {admission_s * 1e6:.0f} us per admission and release; one "
            f"router sustains {rates} per batch",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "router_admission.jsonl").open("a") as f:
        out = {
            "label": args.label,
            "transport": "ray" if args.ray_calls else "socket",
            "replicas": args.replicas,
            "slots": args.slots,
        }
        f.write(json.dumps(out | {"rows": rows, "bound": bound}) + "\n")


if __name__ == "__main__":
    main()
