"""The DeepSeekRouter's compute per decision, per policy, without Ray.

    .venv/bin/python -m tests.perf.router_decisions [--replicas 16] [--n 20000]

A saturated cluster of ``--replicas`` replicas (16 slots each, every slot busy,
queues of all three classes) where each release frees one slot and dispatches one
queued request: the steady state under overload. Prints microseconds per
submit + dispatch, p50 and p99, for each policy (expert-aware with 16 experts and
the expert breaker on; prefix-aware with one 256-token prompt's 16 blocks cached
per replica).
"""

from __future__ import annotations

import argparse
import random
import time

from cluster.config import RouterConfig
from cluster.qos import QoS
from kvstore.block_hash import block_hashes
from router.core import RouterCore
from router.settings import CoreSettings
from router.types import (
    KVEvent,
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    RouteDecision,
    Ticket,
)

EXPERTS = 16


def run(policy: str, replicas: int, n: int) -> tuple[float, float]:
    cfg = RouterConfig.model_validate(
        {
            "policy": policy,
            "max_running_per_replica": 16,
            "realtime_reserved_slots": 0,
            "max_queued": {"realtime": 10**6, "normal": 10**6, "background": 10**6},
            "expert_capacity_tokens": 10**9 if policy == "expert" else None,
        }
    )
    clock = [0.0]
    core = RouterCore(CoreSettings.of(cfg), num_experts=EXPERTS, clock=lambda: clock[0])
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(256)] for _ in range(32)]
    hashes = [block_hashes(p, 16) for p in prompts]
    for r in range(replicas):
        events = [KVEvent("stored", hashes[r % len(hashes)])]
        core.report(ReplicaReport(ReplicaId(f"r{r}"), kv_events=events))

    def ticket(i: int) -> Ticket:
        k = i % len(prompts)
        hist = tuple(rng.randrange(40) for _ in range(EXPERTS))
        return Ticket(f"t{i}", QoS(i % 3), 256, 64, None, hashes[k], hist)

    for i in range(replicas * 16 + 300):  # fill every slot, then queue 300
        core.submit(ticket(i))
    running = [rid for r in core.replicas.values() for rid in r.leases]
    times = []
    i = replicas * 16 + 300
    for _ in range(n):
        clock[0] += 0.01
        done = running.pop(0)
        t0 = time.perf_counter()
        core.release(Release(done, Outcome.OK, None, 0.05))
        t = ticket(i)
        submitted = core.submit(t)
        dispatched = core.pump() + list(submitted.dispatched)
        times.append(time.perf_counter() - t0)
        running += [w.ticket.request_id for w, _ in dispatched]
        if isinstance(submitted.outcome, RouteDecision):
            running.append(t.request_id)
        i += 1
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--n", type=int, default=20000)
    args = p.parse_args()
    print(f"{args.replicas} replicas x 16 slots, saturated, 300 queued")
    print("| policy | release + submit + dispatch p50 (us) | p99 (us) |")
    print("|---|---|---|")
    for policy in ("least_loaded", "weighted_round_robin", "prefix", "expert"):
        p50, p99 = run(policy, args.replicas, args.n)
        print(f"| {policy} | {p50:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    main()
