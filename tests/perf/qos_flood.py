"""Realtime TTFT alone and under a background flood, with and without the router.

    .venv/bin/python -m tests.perf.qos_flood [--capacity REQ_S] [--duration 30]
        [--modes router,guard,yield,no-router]  # QOS_FLOOD_BATCH_MATES=0: K
                                                # QOS_FLOOD_CPU_YIELD=0.8
                                                # QOS_FLOOD_PREFILL_TOKENS=64
        [--server-json '{"haproxy": true}']

Two moe-cluster engine replicas (one core each) on the tiny model, driven over gRPC
by ``moe-cluster bench``'s load generator. For each mode (the DeepSeekRouter's QoS
admission; then ``router.enabled: false``, Serve's own first-come routing):

- realtime alone: 2 req/s (Poisson), 64 prompt / 32 output tokens;
- the same realtime stream under background at 2x capacity (128 / 64 tokens);
- (every mode but Serve routing) that background alone, for the throughput realtime
  costs it.

Modes: the router; the router with ``engine.realtime_batch_mates`` (background
pauses in an engine while realtime is in it); that, ``engine.background_cpu_yield``
(an engine with only background idles while the other holds realtime: the two
engines share the machine's cores) and ``engine.background_prefill_tokens`` (a
step computes few background prompt tokens, so realtime arriving mid-step waits
less); Serve's own routing.

Capacity is the background shape's closed-loop request rate at 32 streams, measured
once on the first mode. Also prints the router's own compute time per decision and
the ingress-to-router admission round trip on an idle cluster. Writes
``tests/perf/results/qos_flood-<backend>.{json,md}`` (``amx_mla`` on a CPU with AMX,
``cpu_mla`` on any other).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from deployments.bench.backends import GrpcBackend
from deployments.bench.report import Slo
from deployments.bench.workload import ClassSpec, LengthRange, Workload
from tests.perf.compare_peers import (
    PORT,
    RESULTS,
    Peer,
    Server,
    _module,
    drive,
    per_cpu,
)

TARGET = f"127.0.0.1:{PORT + 1}"
SLO = Slo(ttft_ms=1000)
REALTIME = ClassSpec(
    "realtime", rate=2.0, input_len=LengthRange(64, 64), output_len=LengthRange(32, 32)
)
BACKGROUND = ClassSpec(
    "background", input_len=LengthRange(128, 128), output_len=LengthRange(64, 64)
)
GUARD_MATES = int(os.environ.get("QOS_FLOOD_BATCH_MATES", "0"))  # guard modes'
CPU_YIELD = float(os.environ.get("QOS_FLOOD_CPU_YIELD", "0.8"))  # yield mode's
# The yield mode's engine.background_prefill_tokens ("": none).
PREFILL_CAP = os.environ.get("QOS_FLOOD_PREFILL_TOKENS", "64")


def _engine_mode(key: str, engine: dict[str, Any]) -> Peer:
    """The router with these ``engine`` settings (``--engine-json``)."""
    label = ", ".join(f"engine.{k}: {v}" for k, v in engine.items())
    command = _module("moe-cluster", "--engine-json", json.dumps(engine))
    return Peer(key, f"router QoS, {label}", command, ())


MODES = (
    Peer("router", "router QoS", _module("moe-cluster"), ()),
    _engine_mode("guard", {"realtime_batch_mates": GUARD_MATES}),
    _engine_mode(
        "yield",
        {"realtime_batch_mates": GUARD_MATES, "background_cpu_yield": CPU_YIELD}
        | ({"background_prefill_tokens": int(PREFILL_CAP)} if PREFILL_CAP else {}),
    ),
    Peer(
        "no-router",
        "Serve routing (router off)",
        _module("moe-cluster", "--no-router"),
        (),
    ),
)
KEYS = tuple(m.key for m in MODES)  # the table's order


async def _open(workload: Workload, duration_s: float) -> dict[str, Any]:
    return await drive(GrpcBackend(TARGET), workload, SLO, duration_s=duration_s)


async def _capacity() -> float:
    w = Workload((BACKGROUND,), seed=4)
    summary = await drive(GrpcBackend(TARGET), w, SLO, concurrency=32, n=96, warmup=8)
    rate: float = summary["all"]["request_rate"]
    return rate


def _router(method: str) -> Any:
    """Calls a method of the running cluster's router actor."""
    import ray

    from router import actor as router_actor

    ray.init(address="auto", namespace="qos-flood", logging_level="ERROR")
    try:
        handle = ray.get_actor(
            router_actor.actor_name("moe-cluster"), namespace=router_actor.NAMESPACE
        )
        return ray.get(getattr(handle, method).remote())
    finally:
        ray.shutdown()


def _router_latency() -> dict[str, Any]:
    """Admission round trips to the router actor on an idle cluster, and the
    router's own compute per decision over the run."""
    import ray

    from cluster.qos import QoS
    from router import actor as router_actor
    from router.types import Outcome, Release, Ticket

    ray.init(address="auto", namespace="qos-flood", logging_level="ERROR")
    try:
        handle = ray.get_actor(
            router_actor.actor_name("moe-cluster"), namespace=router_actor.NAMESPACE
        )
        snap = ray.get(handle.snapshot.remote()).as_json()
        rtts = []
        for i in range(300):
            t0 = time.perf_counter()
            ray.get(handle.admit.remote(Ticket(f"probe-{i}", QoS.NORMAL, 64, 1)))
            rtts.append(time.perf_counter() - t0)
            handle.release.remote(Release(f"probe-{i}", Outcome.CANCELLED))
        rtts.sort()
        return {
            "decision_us": snap.get("decision_us"),
            "admit_rtt_ms": {
                "p50": rtts[len(rtts) // 2] * 1e3,
                "p99": rtts[int(len(rtts) * 0.99)] * 1e3,
            },
            "shed": snap["shed"],
            "served_ttft_ms": snap["ttft_ms"],
        }
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--capacity", type=float, default=None, help="req/s; skip measuring")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument(
        "--modes",
        default=",".join(KEYS),
        help="comma-separated subset",
    )
    p.add_argument(
        "--server-json",
        default=None,
        help="server settings (JSON) for every mode, e.g. '{\"haproxy\": true}'",
    )
    args = p.parse_args()
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    capacity = args.capacity
    out: dict[str, Any] = {}
    server_args: tuple[str, ...] = ()
    if args.server_json is not None:
        server_args = ("--server-json", args.server_json)
    for mode in [m for m in MODES if m.key in args.modes.split(",")]:
        print(f"== {mode.label}", " ".join(server_args), flush=True)
        # Its clients are not starved by the server's session (see Server).
        log = logs / f"qos-{mode.key}.log"
        server = Server(mode, 2, log, server_args, own_session=False)
        try:
            if capacity is None:
                capacity = asyncio.run(_capacity())
                print(f"capacity {capacity:.2f} req/s", flush=True)
            alone = asyncio.run(_open(Workload((REALTIME,), seed=5), args.duration))
            if mode.key == "router":
                alone["router_ttft_ms"] = _router("snapshot").as_json()["ttft_ms"]
                _router("reset_stats")
            bg = ClassSpec(
                "background",
                rate=2 * capacity,
                input_len=BACKGROUND.input_len,
                output_len=BACKGROUND.output_len,
            )
            flood = asyncio.run(_open(Workload((REALTIME, bg), seed=6), args.duration))
            out[mode.key] = {"alone": alone, "flood": flood}
            if mode.key != "no-router":
                out[mode.key]["background_alone"] = asyncio.run(
                    _open(Workload((bg,), seed=6), args.duration)
                )
            if mode.key == "router":
                out[mode.key]["router"] = _router_latency()
        finally:
            server.stop()
    out["capacity_req_s"] = capacity
    out["server"] = args.server_json or "{}"
    out["guard_batch_mates"] = GUARD_MATES
    out["cpu_yield"] = CPU_YIELD
    out["prefill_cap"] = int(PREFILL_CAP) if PREFILL_CAP else None
    if all(m.key in out for m in MODES):
        stem = per_cpu("qos_flood")
        (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1))
        (RESULTS / f"{stem}.md").write_text(table(out) + "\n")
    print(table(out))


def table(out: dict[str, Any]) -> str:
    rows = [
        "| mode | load | realtime TTFT p50 (ms) | p99 (ms) | realtime TPOT p50 (ms) "
        "| p99 (ms) | realtime refused | background done | background refused "
        "| background tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in [k for k in KEYS if k in out]:
        for load in ("alone", "flood", "background_alone"):
            if load not in out[key]:
                continue
            s = out[key][load]
            rt, bg = s.get("realtime"), s.get("background")
            rows.append(
                f"| {key} | {load.replace('_', ' ')} | "
                + (
                    f"{rt['ttft_ms']['p50']:.0f} | {rt['ttft_ms']['p99']:.0f} | "
                    f"{rt['tpot_ms']['p50']:.2f} | {rt['tpot_ms']['p99']:.2f} | "
                    f"{rt['requests'] - rt['completed']} | "
                    if rt
                    else "- | - | - | - | - | "
                )
                + (
                    f"{bg['completed']} | {bg['requests'] - bg['completed']} | "
                    f"{bg['output_tok_s']:.0f} |"
                    if bg
                    else "- | - | - |"
                )
            )
    if "server" in out:
        rows.append(
            f"\nServer settings: {out['server']}; guard: "
            f"engine.realtime_batch_mates {out['guard_batch_mates']}; yield: the "
            f"guard and engine.background_cpu_yield {out.get('cpu_yield', '-')}"
            + (
                f", engine.background_prefill_tokens {out['prefill_cap']}."
                if out.get("prefill_cap")
                else "."
            )
        )
    ratios = []
    for key in [k for k in KEYS if k in out and "background_alone" in out[k]]:
        alone, flood = out[key]["alone"]["realtime"], out[key]["flood"]["realtime"]
        bg_alone = out[key]["background_alone"]["background"]["output_tok_s"]
        bg = out[key]["flood"]["background"]["output_tok_s"]
        ratios.append(
            f"{key}: realtime TPOT p50 "
            f"{flood['tpot_ms']['p50'] / alone['tpot_ms']['p50']:.2f}x alone, TTFT "
            f"p99 {flood['ttft_ms']['p99'] / alone['ttft_ms']['p99']:.2f}x alone; "
            f"background {bg / bg_alone:.0%} of its throughput alone"
        )
    if ratios:
        rows.append("\nUnder the flood: " + "; ".join(ratios) + ".")
    r = out.get("router", {}).get("router")
    if r is None:
        return "\n".join(rows)
    d, rtt = r["decision_us"], r["admit_rtt_ms"]
    served = [
        (load, t)
        for load, t in (
            ("alone", out["router"]["alone"].get("router_ttft_ms")),
            ("flood", r.get("served_ttft_ms")),
        )
        if t and t.get("realtime")
    ]
    if served:
        rows.append(
            "\nServer side (the router's view: submission to first token at the "
            "ingress), realtime: "
            + "; ".join(
                f"{load} p50 {t['realtime']['p50']:.0f} ms, "
                f"p99 {t['realtime']['p99']:.0f} ms"
                for load, t in served
            )
            + "."
        )
    rows.append(
        f"\nBackground offered at 2 x {out['capacity_req_s']:.2f} req/s (its "
        f"measured capacity). Router compute per dispatched request during the "
        f"runs: p50 {d['p50']:.0f} us, p99 {d['p99']:.0f} us (n={d['n']}). "
        f"Admission round trip to the router actor from another process, idle "
        f"cluster: p50 {rtt['p50']:.2f} ms, p99 {rtt['p99']:.2f} ms."
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
