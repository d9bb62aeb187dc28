import asyncio

import pytest

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.core import RouterCore
from router.service import RouterService
from router.settings import CoreSettings
from router.types import (
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    Shed,
    Ticket,
    Transition,
)
from tests.router.clock import Clock


def _service(clock: Clock, transitions: list[Transition]) -> RouterService:
    cfg = RouterConfig(max_running_per_replica=1, realtime_reserved_slots=0)
    svc = RouterService(
        RouterCore(CoreSettings.of(cfg), clock=clock),
        tick_s=0.01,
        on_transition=transitions.append,
    )
    svc.report(ReplicaReport(ReplicaId("a")))
    return svc


async def test_admit_waits_for_a_free_slot() -> None:
    svc = _service(Clock(), [])
    first = await svc.admit(Ticket("1", QoS.NORMAL, 4, 4))
    assert first.replica_id == "a"
    waiting = asyncio.create_task(svc.admit(Ticket("2", QoS.NORMAL, 4, 4)))
    await asyncio.sleep(0)
    assert not waiting.done()
    svc.release(Release("1", Outcome.OK, ReplicaId("a"), 0.01))
    second = await asyncio.wait_for(waiting, 1)
    assert second.replica_id == "a" and second.reason == "least-loaded"
    assert svc.snapshot().decision_us.n == 2


async def test_cancelled_admit_leaves_the_queue() -> None:
    svc = _service(Clock(), [])
    await svc.admit(Ticket("1", QoS.NORMAL, 4, 4))
    waiting = asyncio.create_task(svc.admit(Ticket("2", QoS.NORMAL, 4, 4)))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert svc.snapshot().queued["normal"] == 0


async def test_ticker_sheds_expired_and_reports_transitions() -> None:
    clock, transitions = Clock(), []
    svc = _service(clock, transitions)
    svc.start()
    try:
        await svc.admit(Ticket("1", QoS.NORMAL, 4, 4))
        waiting = asyncio.create_task(
            svc.admit(Ticket("2", QoS.REALTIME, 4, 4, deadline_s=0.5))
        )
        await asyncio.sleep(0.02)
        clock.advance(0.5)
        with pytest.raises(Shed, match="can no longer be met"):
            await asyncio.wait_for(waiting, 1)
        for _ in range(3):
            svc.release(Release("x", Outcome.FAILED, ReplicaId("a")))
        assert [(t.key, t.new) for t in transitions] == [("a", "open")]
    finally:
        await svc.stop()


async def test_requests_dispatched_while_another_is_shed_are_delivered() -> None:
    cfg = RouterConfig.model_validate(
        {
            "max_running_per_replica": 1,
            "realtime_reserved_slots": 0,
            "max_queued": {"realtime": 1, "normal": 1, "background": 0},
        }
    )
    svc = RouterService(RouterCore(CoreSettings.of(cfg), clock=Clock()))
    queued = asyncio.create_task(svc.admit(Ticket("q", QoS.NORMAL, 4, 4)))
    await asyncio.sleep(0)  # no replica yet: it waits
    # The replica appears in the core only (no pump); then a background request,
    # whose queue has no room, arrives: its submit dispatches "q" on the way.
    svc.core.report(ReplicaReport(ReplicaId("a")))
    with pytest.raises(Shed, match="background queue is full"):
        await asyncio.wait_for(svc.admit(Ticket("x", QoS.BACKGROUND, 4, 4)), 1)
    assert (await asyncio.wait_for(queued, 1)).replica_id == "a"


async def test_replicas_dropped_for_silence_are_told_to_whoever_follows() -> None:
    clock = Clock()
    svc = _service(clock, [])
    svc.report(ReplicaReport(ReplicaId("b")))
    assert await svc.lost_replicas(-1, 0) == (0, [])  # where to follow from
    waiting = [asyncio.create_task(svc.lost_replicas(0, 5)) for _ in range(2)]
    short = asyncio.create_task(svc.lost_replicas(0, 0.01))
    assert await short == (0, [])  # timed out; the others still wait
    clock.advance(60)
    svc.report(ReplicaReport(ReplicaId("b")))
    svc.tick()
    assert await asyncio.wait_for(asyncio.gather(*waiting), 1) == [(1, ["a"])] * 2
    clock.advance(60)
    svc.tick()
    assert await svc.lost_replicas(0, 0) == (2, ["a", "b"])  # missed ones too
    assert await svc.lost_replicas(1, 0) == (2, ["b"])
    # A since this service never gave (its router restarted): start over.
    assert await svc.lost_replicas(7, 0) == (2, [])


async def test_an_idle_router_ticks_slowly_and_a_request_wakes_it() -> None:
    # Idle (nothing queued or in flight), the ticker waits idle_tick_s; the
    # request that arrives meanwhile and queues is shed on time all the same.
    clock, transitions = Clock(), []
    cfg = RouterConfig(max_running_per_replica=1, realtime_reserved_slots=0)
    svc = RouterService(
        RouterCore(CoreSettings.of(cfg), clock=clock),
        tick_s=0.01,
        idle_tick_s=3600,
        on_transition=transitions.append,
    )
    svc.report(ReplicaReport(ReplicaId("a")))
    ticks = 0
    tick = svc.tick

    def counted() -> None:
        nonlocal ticks
        ticks += 1
        tick()

    svc.tick = counted  # type: ignore[method-assign]
    svc.start()
    try:
        await asyncio.sleep(0.1)
        assert svc.core.idle() and ticks == 0  # ten busy ticks' worth, none run
        await svc.admit(Ticket("1", QoS.NORMAL, 4, 4))
        waiting = asyncio.create_task(
            svc.admit(Ticket("2", QoS.REALTIME, 4, 4, deadline_s=0.5))
        )
        await asyncio.sleep(0.05)
        busy_ticks = ticks
        assert busy_ticks >= 2  # woken by the first request, busy since
        clock.advance(0.5)
        with pytest.raises(Shed, match="can no longer be met"):
            await asyncio.wait_for(waiting, 1)
        svc.release(Release("1", Outcome.OK, ReplicaId("a"), 0.01))
        await asyncio.sleep(0.05)
        assert svc.core.idle()
        settled = ticks
        await asyncio.sleep(0.1)
        assert ticks <= settled + 1  # idle again: at most the tick under way
    finally:
        await svc.stop()


def test_idle_means_nothing_queued_in_flight_or_open() -> None:
    cfg = RouterConfig(max_running_per_replica=1, realtime_reserved_slots=0)
    core = RouterCore(CoreSettings.of(cfg), clock=Clock())
    assert core.idle()
    core.report(ReplicaReport(ReplicaId("a")))
    assert core.idle()
    core.submit(Ticket("1", QoS.NORMAL, 4, 4))
    assert not core.idle()  # in flight
    core.submit(Ticket("2", QoS.NORMAL, 4, 4))
    core.release(Release("1", Outcome.OK, ReplicaId("a"), 0.01))
    core.pump()
    assert not core.idle()  # "2" runs now
    core.release(Release("2", Outcome.OK, ReplicaId("a"), 0.01))
    assert core.idle()
