"""Stopping the cluster: the router refuses what is queued and what comes, and
lets what runs (and its resumptions) finish."""

import asyncio

import grpc

from cluster.config import RouterConfig
from cluster.qos import QoS
from deployments.ingress.errors import status_of
from router.admission import Waiting
from router.core import RouterCore
from router.service import RouterService
from router.settings import CoreSettings
from router.types import (
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    RouteDecision,
    Shed,
    Ticket,
)
from tests.router.clock import Clock
from tests.router.support import submit


def _core() -> RouterCore:
    cfg = RouterConfig.model_validate(
        {"max_running_per_replica": 1, "realtime_reserved_slots": 0}
    )
    core = RouterCore(CoreSettings.of(cfg), clock=Clock())
    core.report(ReplicaReport(ReplicaId("a")))
    return core


def test_closing_refuses_the_queued_and_new_requests_but_not_resumptions() -> None:
    core = _core()
    assert isinstance(submit(core, Ticket("run", QoS.NORMAL, 8, 8)), RouteDecision)
    assert isinstance(submit(core, Ticket("queued", QoS.REALTIME, 8, 8)), Waiting)
    assert core.in_flight() == 1
    shed = core.close()
    assert [(w.ticket.request_id, s.reason) for w, s in shed] == [("queued", "closing")]
    refused = core.submit(Ticket("new", QoS.REALTIME, 8, 8)).outcome
    assert isinstance(refused, Shed) and refused.reason == "closing"
    assert refused.retry_after_s > 0
    assert status_of(refused).grpc_code == grpc.StatusCode.UNAVAILABLE
    assert status_of(refused).http_status == 503
    # A stream moving off a failed replica is not new work: it may still run.
    core.release(Release("run", Outcome.FAILED, ReplicaId("a")))
    assert core.in_flight() == 0
    resumed = core.submit(Ticket("run", QoS.NORMAL, 12, 4, resumed=True)).outcome
    assert isinstance(resumed, RouteDecision)
    assert core.in_flight() == 1
    assert core.snapshot().shed["realtime/closing"] == 2


def test_the_service_tells_a_queued_caller_it_was_refused() -> None:
    async def run() -> None:
        service = RouterService(_core())
        await service.admit(Ticket("run", QoS.NORMAL, 8, 8))
        waiting = asyncio.ensure_future(service.admit(Ticket("q", QoS.NORMAL, 8, 8)))
        await asyncio.sleep(0)
        assert service.close() == 1
        try:
            await waiting
        except Shed as e:
            assert e.reason == "closing"
        else:
            raise AssertionError("the queued request was dispatched")

    asyncio.run(run())
