"""The DeepSeekRouter actor's methods as a plain object on one event loop."""

from __future__ import annotations

import asyncio

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.actor import DeepSeekRouter
from router.stats import RouterStats
from router.types import Outcome, Release, ReplicaId, ReplicaReport, Shed, Ticket


async def test_the_actor_admits_refuses_and_reports_through_its_service() -> None:
    config = RouterConfig(
        max_running_per_replica=1,
        realtime_reserved_slots=0,
        max_queued={"realtime": 0, "normal": 0, "background": 0},
    )
    router = DeepSeekRouter(config, num_experts=0)
    try:
        ack = await router.report(ReplicaReport(ReplicaId("a"), node_id="n1"))
        assert ack.incarnation == router.incarnation  # a replica tells a restart
        assert not ack.draining
        decision = await router.admit(Ticket("t1", QoS.NORMAL, 8, 4))
        assert not isinstance(decision, Shed) and decision.replica_id == "a"
        # The only slot is taken and no queue: refused, returned (not raised).
        shed = await router.admit(Ticket("t2", QoS.NORMAL, 8, 4))
        assert isinstance(shed, Shed) and shed.reason == "queue-full"
        await router.release(Release("t1", Outcome.OK, ReplicaId("a"), ttft_s=0.02))

        stats = await router.snapshot()
        assert isinstance(stats, RouterStats)
        assert stats.admitted["normal"] == 1 and stats.shed == {"normal/queue-full": 1}
        assert stats.replicas["a"].node == "n1" and stats.replicas["a"].running == 0
        assert stats.ttft_ms["normal"] is not None
        await router.reset_stats()
        assert (await router.snapshot()).ttft_ms["normal"] is None
        assert await router.config() == config
        # Serve stops "a": its next report is told to drain.
        await router.serving_changed([], [ReplicaId("a")])
        ack = await router.report(ReplicaReport(ReplicaId("a"), node_id="n1"))
        assert ack.draining and (await router.snapshot()).replicas["a"].draining
        assert await router.follows_stores() is None
    finally:
        for task in router._tasks:
            task.cancel()


async def test_news_answers_a_replica_of_a_new_router_or_a_drain_at_once() -> None:
    router = DeepSeekRouter(RouterConfig(), num_experts=0)
    a = ReplicaId("a")
    try:
        # A replica that reported to another incarnation: answered at once.
        assert await router.news(a, "before", False, 30) == (router.incarnation, False)
        # Nothing new within the wait: the same answer it asked against.
        assert await router.news(a, router.incarnation, False, 0.05) == (
            router.incarnation,
            False,
        )
        pending = [
            asyncio.ensure_future(router.news(rid, router.incarnation, False, 30))
            for rid in (a, ReplicaId("b"))
        ]
        await asyncio.sleep(0.05)
        assert not any(p.done() for p in pending)
        await router.serving_changed([], [a])  # Serve stops "a"
        assert await asyncio.wait_for(pending[0], 1) == (router.incarnation, True)
        await asyncio.sleep(0.05)
        assert not pending[1].done()  # "b" heard nothing: it still waits
        await router.serving_changed([a], [])  # ... and keeps it after all
        assert await router.news(a, router.incarnation, True, 30) == (
            router.incarnation,
            False,
        )
        pending[1].cancel()
    finally:
        for task in router._tasks:
            task.cancel()
