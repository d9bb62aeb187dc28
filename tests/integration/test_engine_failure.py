"""A replica whose vLLM engine dies mid-stream: its streams go on on the other
replica from the tokens already sent (their KV loaded, not recomputed) with
exactly the tokens of an uninterrupted run; the router's breaker opens on it
and traffic moves to the other replica while Serve replaces it."""

from __future__ import annotations

import time
from typing import Any

import psutil
import ray

from kvstore import actor as kv_actor
from tests.integration import streams
from tests.integration.conftest import (
    Served,
    engine_stats,
    metric_lines,
    wait_until,
)
from tests.integration.test_kvstore import BLOCK, generate, unique_prompt
from tests.integration.test_router import router_snapshot

RUN_LAST = True  # kills an engine; the cluster heals within the test
STREAMS = 6  # least-loaded placement puts 3 on each replica
MAX_TOKENS = 640
# Killed once every stream has this many: two full blocks (saved to the page
# store) and some, with most of the stream still to come.
KILL_AFTER = 2 * BLOCK + 8


def test_a_dead_engines_streams_resume_elsewhere_and_its_breaker_opens(
    served: Served, engine_handle: Any
) -> None:
    # Pages the node's store holds before the replica dies.
    store = next(iter(kv_actor.stores(served.config.server.app_name).values()))
    store_before = ray.get(store.summary.remote())

    rids = [f"doomed-{i}" for i in range(STREAMS)]
    outcomes, readers = streams.start(
        served, rids, [410, 465, 14], MAX_TOKENS, KILL_AFTER
    )
    before = wait_until(lambda: engine_stats(engine_handle), 30, "both replicas")
    (victim,) = [s for s in before.values() if "doomed-0" in s.request_ids]
    on_victim = [r for r in rids if r in victim.request_ids]
    assert len(on_victim) == STREAMS // 2, "least-loaded spreads the streams evenly"
    children = psutil.Process(victim.pid).children(recursive=True)
    assert children, "the engine core runs in a child process of the replica"
    for child in children:
        child.kill()
    killed_at = time.monotonic()

    streams.join(readers, 90)
    # Pages the node's store holds while the replacement starts: served from the
    # store 4 times, the cluster's hottest prefix.
    kept = unique_prompt(6 * BLOCK + 1)
    for _ in range(5):
        generate(engine_handle, "", kept)
    # Every stream finished, with the same greedy tokens and text: those on the
    # dead engine went on on the other replica where they were cut.
    streams.uninterrupted(outcomes, on_victim, MAX_TOKENS)
    for rid in rids:
        finished = outcomes[rid].finished
        assert finished.prompt_tokens == 3
        if rid in on_victim:
            assert finished.migrations == 1, rid
            assert finished.replica_id != victim.replica_id
            # Its prompt and the blocks the dead engine saved: loaded, not
            # computed again.
            assert finished.cached_tokens >= 2 * BLOCK, (rid, finished)
        else:
            assert finished.migrations == 0
    seams = sorted(max(outcomes[r].gaps()) for r in on_victim)
    print(f"resume gap (longest pause per migrated stream): {seams} s")

    # Three failures in a row: the router opened the victim's breaker ...
    transitions = router_snapshot(served).transitions
    opened = [t for t in transitions if t.key == victim.replica_id]
    assert opened and opened[0].new == "open", transitions
    assert opened[0].detail == "3 consecutive failures"
    # ... an event in the trace of the failure that opened it ...
    assert served.traces is not None
    traces = served.traces

    def opened_in_a_trace() -> Any:
        return next(
            (
                (s, attrs)
                for s in traces.spans()
                if s.name == "router.release"
                for name, attrs in s.events
                if name == "breaker.transition"
                and attrs["key"] == victim.replica_id
                and attrs["to"] == "open"
            ),
            None,
        )

    release, _ = wait_until(opened_in_a_trace, 30, "the breaker event in a trace")
    assert release.attributes["moe_cluster.router.outcome"] == "failed"

    def request_spans() -> list[Any]:
        # The ingress exports the request's span when the stream ends, which
        # may be after the router exported its release: wait for it too.
        return [
            s
            for s in traces.spans(release.trace_id)
            if s.name.startswith("text_completion")
        ]

    [request_span] = wait_until(request_spans, 30, "the request's span")
    # The request went on: no error, its migration an event of its span.
    assert not request_span.error
    assert request_span.attributes["moe_cluster.migrations"] == 1
    [(_, migration)] = [e for e in request_span.events if e[0] == "migration"]
    assert migration["moe_cluster.replica"] == victim.replica_id
    assert migration["moe_cluster.migration.tokens_sent"] >= KILL_AFTER
    # ... and traffic goes to the surviving replica meanwhile.
    streams.served_elsewhere(served, victim.replica_id)

    def metric_shows_it() -> bool:
        lines = metric_lines(served, "ray_moe_cluster_router_breaker_transitions_total")
        return any(
            f'key="{victim.replica_id}"' in line and 'to="open"' in line
            for line in lines
        )

    wait_until(metric_shows_it, 60, "the breaker transition on the metrics endpoint")

    def replaced() -> bool:
        now = engine_stats(engine_handle)
        return len(now) == 2 and victim.replica_id not in now

    wait_until(replaced, 180, "Serve to replace the replica with the dead engine")
    print(
        f"replica replaced {time.monotonic() - killed_at:.1f} s after its engine died"
    )

    def routable() -> bool:
        replicas = router_snapshot(served).replicas
        return len(replicas) == 2 and victim.replica_id not in replicas

    wait_until(routable, 30, "the router to route to the replacement only")

    # The node's pages outlived the replica: its replacement loads them.
    now = engine_stats(engine_handle)
    (new,) = set(now) - set(before)
    # It ran the cluster's hot prefixes (loaded from the store) before traffic...
    assert now[new].warmed_prefixes >= 1
    assert now[new].warmed_cached_tokens >= 5 * BLOCK
    # The warmup is a trace of its own, each prefill's vLLM span under it.
    assert served.traces is not None
    traces = served.traces

    def warmup() -> Any:
        return next(
            (
                s
                for s in traces.spans()
                if s.name == "engine.warmup"
                and s.attributes.get("moe_cluster.replica") == new
            ),
            None,
        )

    span = wait_until(warmup, 30, "the replacement's warmup span")
    assert span.attributes["moe_cluster.warmup.prompts"] == now[new].warmed_prefixes
    assert span.attributes["moe_cluster.warmup.cached_tokens"] == (
        now[new].warmed_cached_tokens
    )

    def prefills() -> list[Any]:
        # vLLM's spans, which its own exporter sends: they may come after.
        return [s for s in traces.spans(span.trace_id) if s.name == "llm_request"]

    wait_until(
        lambda: len(prefills()) >= now[new].warmed_prefixes, 30, "the prefills' spans"
    )
    assert len(prefills()) == now[new].warmed_prefixes
    # ... and serves the pages stored before the crash.
    assert generate(engine_handle, new, kept).finish.cached_tokens == 6 * BLOCK
    store_after = ray.get(store.summary.remote())
    assert store_after["node"] == store_before["node"]
    assert store_after["saved_pages"] >= store_before["saved_pages"]
