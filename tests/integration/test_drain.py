"""Scaling the engines down while streams run: the replica Serve stops takes no new
work, its streams run for the drain timeout and are then handed off, each resumed
on the other replica with exactly the tokens of an uninterrupted run; none fails
and no breaker opens. Scaling back up adds a replica that warms from the page store
before the router feeds it. The session's app takes its replica count from an
external scaler (Serve's ``update_deployment_replicas``), which changes the count
without redeploying, as Serve's autoscaler does."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from tests.integration import streams
from tests.integration.conftest import Served, engine_stats, wait_until
from tests.integration.test_kvstore import BLOCK
from tests.integration.test_router import router_snapshot

RUN_LAST = True  # scales the session's engines down and back up
STREAMS = 6  # least-loaded placement puts 3 on each replica
# Long enough to outlast the drain timeout on any CPU (an AMX engine runs 640
# tokens of 3 streams in ~6 s), and short enough that a stream's pages (all six
# are the same greedy tokens) stay in the test's 64-page store, where the new
# replica's warmup finds them: 1600 tokens on AMX_MLA (13 pages), 768 on
# CPU_MLA's 16-token blocks (48 pages, ~12 s).
MAX_TOKENS = min(1600, 48 * BLOCK)
# Scaled down once every stream has two full blocks (saved to the page store).
SCALE_AFTER = 2 * BLOCK + 8


def scale(served: Served, replicas: int) -> None:
    from deployments.app import scale_engines

    scale_engines(served.config.server.app_name, replicas)


def test_a_replica_scaled_away_drains_and_hands_its_streams_off(
    served: Served, engine_handle: Any
) -> None:
    drain_s = served.config.deployment.drain_timeout_s
    before = wait_until(
        lambda: s if len(s := engine_stats(engine_handle)) == 2 else None,
        60,
        "both replicas",
    )
    rids = [f"drained-{i}" for i in range(STREAMS)]
    prompt = [411, 466, 15]
    outcomes, readers = streams.start(served, rids, prompt, MAX_TOKENS, SCALE_AFTER)
    on = {
        rid: s.replica_id
        for s in engine_stats(engine_handle).values()
        for rid in s.request_ids
        if rid in rids
    }
    assert len(on) == STREAMS, on

    scaled_at = time.monotonic()
    scale(served, 1)

    def stopping() -> str | None:
        draining = [
            r for r, s in router_snapshot(served).replicas.items() if s.draining
        ]
        return draining[0] if draining else None

    victim = wait_until(stopping, 30, "the router to see a replica stopping")
    told_at = time.monotonic()
    assert not any(o.finished for o in outcomes.values()), "streams ended too soon"
    # While it drains, new work goes to the other replica only.
    streams.served_elsewhere(served, victim)

    streams.join(readers)
    # None failed; each has the tokens of an uninterrupted run.
    on_victim = [r for r in rids if on[r] == victim]
    assert len(on_victim) == STREAMS // 2, on
    streams.uninterrupted(outcomes, on_victim, MAX_TOKENS)
    for rid in rids:
        out, finished = outcomes[rid], outcomes[rid].finished
        if rid not in on_victim:
            assert finished.migrations == 0, rid
            continue
        # It ran on for the drain timeout, then went on on the other replica
        # from the blocks the stopped engine saved.
        assert finished.migrations == 1, rid
        assert finished.replica_id != victim
        assert finished.cached_tokens >= 2 * BLOCK, (rid, finished)
        resumed = out.resumed_at(streams.migrated_after(served, rid)) - told_at
        assert resumed >= drain_s - 1.0, (rid, resumed)
    print(
        f"scaled down: router told {told_at - scaled_at:.2f} s after the scale call; "
        f"{len(on_victim)} streams handed off after the {drain_s:.0f} s drain"
    )
    # A hand-off is not a failure: the stopped replica's breaker never opened.
    assert not [
        t
        for t in router_snapshot(served).transitions
        if t.key == victim and t.new == "open"
    ]
    wait_until(
        lambda: list(engine_stats(engine_handle)) == [r for r in before if r != victim],
        60,
        "Serve to stop the drained replica",
    )

    # Scaled back up: the new replica warms from the page store first, and the
    # router feeds it once it reports.
    scale(served, 2)

    def two_serving() -> dict[str, Any] | None:
        replicas = router_snapshot(served).replicas
        ok = len(replicas) == 2 and not any(
            s.draining or s.starting for s in replicas.values()
        )
        return replicas if ok else None

    replicas = wait_until(two_serving, 180, "the router to route to 2 replicas")
    (new,) = set(replicas) - set(before)
    # Asked by name once this process's handle knows it (the router may first).
    stats = wait_until(
        lambda: engine_stats(engine_handle).get(new), 60, "the new replica's stats"
    )
    assert stats.warmed_prefixes >= 1 and stats.warmed_cached_tokens >= BLOCK
    # What the router places on it runs there: least-loaded puts 2 of 4 new
    # streams on each replica (none lands elsewhere while Serve's handles learn
    # of the new one).
    rids = [f"after-{i}" for i in range(4)]
    _, readers = streams.start(served, rids, [412, 467, 16], 256, 8)
    on = {
        rid: s.replica_id
        for s in engine_stats(engine_handle).values()
        for rid in s.request_ids
        if rid in rids
    }
    streams.join(readers)
    assert Counter(on.values()) == dict.fromkeys(replicas, 2), on
