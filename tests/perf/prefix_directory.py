"""What the router's prefix view costs: report sizes, router memory, decision time.

    .venv/bin/python -m tests.perf.prefix_directory [--replicas 8] [--nodes 2]
        [--store-pages 910] [--engine-blocks 455] [--block 128] [--mode both]

``--replicas`` replicas spread over ``--nodes`` nodes, each node's page store full
(``--store-pages``; 910 is the tiny model's bf16 128-token pages in the default
512 MiB store, 3640 its float32 16-token pages) and each engine's own prefix cache
full (``--engine-blocks``; 455 and 1820 for a 256 MiB engine cache). The pages are
chains of 8 blocks, as prompts leave them. Two ways to tell the router what each
replica can serve:

- ``per-replica``: every replica reports its engine's blocks and its node store's
  pages as its own (the router holds each stored page once per replica);
- ``directory``: a replica reports only its engine's blocks and its node; the
  router follows the kvstore directory's change log for what each node's store
  holds, once for the cluster.

Prints, per mode: the bytes of every replica's full report (a restarted router
asks for it), the bytes that cross to the router per report interval while the
stores and engines churn (``--churn`` pages in and out per store, a quarter of it
per engine), the (replica or node, block) entries the router holds, the router's
compute to apply one interval of reports, and its compute per placement with the
``prefix`` policy (submit + release, p50/p99).
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from collections.abc import Callable

from cluster.config import RouterConfig
from cluster.qos import QoS
from kvstore.block_hash import BlockHash, block_hashes
from kvstore.node_store import Changes
from router.core import RouterCore
from router.settings import CoreSettings
from router.types import KVEvent, Outcome, Release, ReplicaId, ReplicaReport, Ticket

CHAIN = 8  # blocks per stored prompt prefix
INTERVALS = 20  # report intervals measured (medians printed)


def chains(
    rng: random.Random, n_blocks: int, block: int
) -> list[tuple[BlockHash, ...]]:
    out = []
    for _ in range(max(1, n_blocks // CHAIN)):
        tokens = [rng.randrange(50_000) for _ in range(CHAIN * block)]
        out.append(tuple(block_hashes(tokens, block)))
    return out


class Cluster:
    """What each node's store and each replica's engine holds, and its churn."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.args, self.rng = args, rng
        self.nodes = [f"node-{n}" for n in range(args.nodes)]
        self.replicas = [ReplicaId(f"replica-{r}") for r in range(args.replicas)]
        self.node_of = {
            r: self.nodes[i % args.nodes] for i, r in enumerate(self.replicas)
        }
        self.store: dict[str, list[tuple[BlockHash, ...]]] = {
            n: chains(rng, args.store_pages, args.block) for n in self.nodes
        }
        # An engine caches prefixes its node's store also holds, and some of its own.
        self.engine: dict[ReplicaId, list[tuple[BlockHash, ...]]] = {}
        for r in self.replicas:
            stored = self.store[self.node_of[r]]
            k = args.engine_blocks // CHAIN
            shared = rng.sample(stored, min(len(stored), k // 2))
            self.engine[r] = shared + chains(rng, (k - len(shared)) * CHAIN, args.block)

    def store_pages(self, node: str) -> set[BlockHash]:
        return {h for c in self.store[node] for h in c}

    def engine_blocks(self, r: ReplicaId) -> set[BlockHash]:
        return {h for c in self.engine[r] for h in c}

    def churn(
        self, chains_of: list[tuple[BlockHash, ...]], pages: int
    ) -> tuple[tuple[BlockHash, ...], tuple[BlockHash, ...]]:
        """Evicts ``pages`` (whole chains, oldest first) and stores as many new."""
        gone = [chains_of.pop(0) for _ in range(max(1, pages // CHAIN))]
        new = chains(self.rng, len(gone) * CHAIN, self.args.block)
        chains_of.extend(new)
        return tuple(h for c in new for h in c), tuple(h for c in gone for h in c)


def router(policy: str = "prefix") -> RouterCore:
    cfg = RouterConfig.model_validate(
        {
            "policy": policy,
            "max_running_per_replica": 10**6,
            "realtime_reserved_slots": 0,
        }
    )
    return RouterCore(CoreSettings.of(cfg), clock=time.monotonic)


def size(obj: object) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def per_replica(c: Cluster, core: RouterCore) -> dict[str, float]:
    """Each replica reports its engine's blocks and its node's pages as its own."""
    full = [
        ReplicaReport(
            r,
            kv_events=(
                KVEvent("cleared"),
                KVEvent(
                    "stored",
                    tuple(c.engine_blocks(r) | c.store_pages(c.node_of[r])),
                ),
            ),
        )
        for r in c.replicas
    ]
    for report in full:
        core.report(report)
    held = sum(core.directory.num_blocks(r) for r in c.replicas)
    applied, sent = [], []
    for _ in range(INTERVALS):
        # One interval: each store and engine churns; every replica reports what it
        # gained and lost of the union (a page both held stays while one holds it).
        before = {
            r: c.engine_blocks(r) | c.store_pages(c.node_of[r]) for r in c.replicas
        }
        for n in c.nodes:
            c.churn(c.store[n], c.args.churn)
        reports = []
        for r in c.replicas:
            c.churn(c.engine[r], c.args.churn // 4)
            after = c.engine_blocks(r) | c.store_pages(c.node_of[r])
            events = (
                KVEvent("stored", tuple(after - before[r])),
                KVEvent("removed", tuple(before[r] - after)),
            )
            reports.append(ReplicaReport(r, kv_events=events))
        applied.append(timed(lambda rs=reports: [core.report(x) for x in rs]))
        sent.append(sum(size(x) for x in reports))
    return {
        "full_report_bytes": sum(size(x) for x in full),
        "interval_bytes": statistics.median(sent),
        "held_entries": held,
        "apply_interval_us": statistics.median(applied) * 1e6,
    }


def directory(c: Cluster, core: RouterCore) -> dict[str, float]:
    """Replicas report their engines' blocks and node; the router follows the
    cluster's store directory (``(node, page)`` entries)."""
    full = [
        ReplicaReport(
            r,
            kv_events=(
                KVEvent("cleared"),
                KVEvent("stored", tuple(c.engine_blocks(r))),
            ),
            node_id=c.node_of[r],
        )
        for r in c.replicas
    ]
    snapshot = Changes(
        0, True, tuple((n, h) for n in c.nodes for h in sorted(c.store_pages(n)))
    )
    for report in full:
        core.report(report)
    core.follow_stores(snapshot)
    held = sum(core.directory.num_blocks(r) for r in c.replicas) + sum(
        core.prefixes.stores.summary().values()
    )
    applied, sent = [], []
    for _ in range(INTERVALS):
        added: list[tuple[str, BlockHash]] = []
        removed: list[tuple[str, BlockHash]] = []
        for n in c.nodes:
            s_in, s_out = c.churn(c.store[n], c.args.churn)
            added += [(n, h) for h in s_in]
            removed += [(n, h) for h in s_out]
        delta = Changes(1, False, tuple(added), tuple(removed))
        reports = []
        for r in c.replicas:
            e_in, e_out = c.churn(c.engine[r], c.args.churn // 4)
            events = (KVEvent("stored", e_in), KVEvent("removed", e_out))
            reports.append(ReplicaReport(r, kv_events=events, node_id=c.node_of[r]))

        def apply(
            delta: Changes[tuple[str, BlockHash]] = delta,
            reports: list[ReplicaReport] = reports,
        ) -> None:
            core.follow_stores(delta)
            for x in reports:
                core.report(x)

        applied.append(timed(apply))
        sent.append(sum(size(x) for x in reports) + size(delta))
    return {
        "full_report_bytes": sum(size(x) for x in full) + size(snapshot),
        "interval_bytes": statistics.median(sent),
        "held_entries": held,
        "apply_interval_us": statistics.median(applied) * 1e6,
    }


def decisions(c: Cluster, core: RouterCore, n: int) -> tuple[float, float, float]:
    """Placement compute for prompts that start with a stored prefix (the case the
    view is for), and the share of their blocks the chosen replica can serve."""
    prompts = [ch for node in c.nodes for ch in c.store[node]]
    prompts += [ch for r in c.replicas for ch in c.engine[r]]
    rng = random.Random(1)
    times = []
    for i in range(n):
        hashes = rng.choice(prompts)
        t = Ticket(f"t{i}", QoS.NORMAL, CHAIN * c.args.block, 16, None, hashes)
        t0 = time.perf_counter()
        out = core.submit(t).outcome
        times.append(time.perf_counter() - t0)
        core.release(Release(t.request_id, Outcome.OK))
        assert not isinstance(out, Exception), out
    q = statistics.quantiles(times, n=100)
    counters = core.counters
    return q[49] * 1e6, q[98] * 1e6, counters.cached_blocks / counters.prompt_blocks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--store-pages", type=int, default=910)
    p.add_argument("--engine-blocks", type=int, default=455)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--churn", type=int, default=64)
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument(
        "--mode", choices=["per-replica", "directory", "both"], default="both"
    )
    args = p.parse_args()
    modes = {"per-replica": per_replica, "directory": directory}
    chosen = list(modes) if args.mode == "both" else [args.mode]
    print(
        f"{args.replicas} replicas on {args.nodes} nodes, {args.store_pages} pages per "
        f"store, {args.engine_blocks} blocks per engine, {args.churn} pages churned "
        "per store per interval"
    )
    print(
        f"{'mode':<12} {'full reports':>13} {'per interval':>13} {'held':>8} "
        f"{'apply':>9} {'decide p50':>11} {'p99':>8} {'hit':>6}"
    )
    for mode in chosen:
        c = Cluster(args, random.Random(0))
        core = router()
        m = modes[mode](c, core)
        p50, p99, hit = decisions(c, core, args.n)
        print(
            f"{mode:<12} {m['full_report_bytes'] / 1024:>10.0f} KiB "
            f"{m['interval_bytes'] / 1024:>9.1f} KiB {m['held_entries']:>8.0f} "
            f"{m['apply_interval_us'] / 1000:>6.2f} ms {p50:>8.1f} µs {p99:>5.1f} µs "
            f"{hit:>6.3f}"
        )


if __name__ == "__main__":
    main()
