"""The router's admission socket: the actor's own methods over a TCP connection."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.qos import QoS
from router import wire
from router.types import Outcome, Release, ReplicaId, RouteDecision, Shed, Ticket
from router.wire import AdmissionLink, AdmissionServer, LinkDown, RouterError
from tests.waiting import until


class Router:
    """admit_many / release_many as the actor answers them: "q..." waits in
    its queue, "shed..." is refused, the rest are placed."""

    def __init__(self) -> None:
        self.released: list[Release] = []
        self.batches: list[list[str]] = []
        self.hold = asyncio.Event()
        self.hold.set()

    async def admit_many(self, tickets: list[Ticket]) -> list[Any]:
        self.batches.append([t.request_id for t in tickets])
        await self.hold.wait()
        out: list[Any] = []
        for t in tickets:
            if t.request_id.startswith("boom"):
                raise ValueError("the router could not take it")
            if t.request_id.startswith("q"):
                out.append(None)
            elif t.request_id.startswith("shed"):
                out.append(Shed("queue-full", "the normal queue is full", 1.5))
            else:
                out.append(RouteDecision(ReplicaId("r1"), "prefix", 2, 0.01, (3, 4)))
        return out

    async def release_many(self, releases: list[Release]) -> None:
        self.released += releases


def ticket(rid: str) -> Ticket:
    return Ticket(
        rid,
        QoS.REALTIME,
        256,
        64,
        2.5,
        (b"h" * 16, b"i" * 16),
        (1, 0, 2),
        (("traceparent", "00-ab-cd-01"),),
        "acme",
        True,
        "r0",
    )


async def serve() -> tuple[Router, AdmissionServer, str]:
    router = Router()
    server = AdmissionServer(router.admit_many, router.release_many)
    return router, server, await server.start("127.0.0.1")


async def test_admissions_and_releases_cross_the_socket_whole() -> None:
    router, server, endpoint = await serve()

    async def where() -> str:
        return endpoint

    link = AdmissionLink(where)
    answers = await link.admit_many([ticket("a"), ticket("q1"), ticket("shed1")])
    decision, waiting, shed = answers
    assert decision == RouteDecision(ReplicaId("r1"), "prefix", 2, 0.01, (3, 4))
    assert waiting is None
    assert isinstance(shed, Shed)
    assert (shed.reason, str(shed), shed.retry_after_s) == (
        "queue-full",
        "the normal queue is full",
        1.5,
    )
    # Concurrent batches are answered each on its own, whatever the order.
    router.hold.clear()
    first = asyncio.ensure_future(link.admit_many([ticket("b")]))
    second = asyncio.ensure_future(link.admit_many([ticket("c")]))
    await until(lambda: len(router.batches) == 3, "both batches in")
    router.hold.set()
    assert [len(await first), len(await second)] == [1, 1]
    release = Release("a", Outcome.FAILED, ReplicaId("r1"), 0.2, (("k", "v"),))
    assert link.release_many([release])
    await until(lambda: router.released, "the release")
    assert router.released == [release]
    link.close()
    await server.stop()


async def test_a_router_that_cannot_be_reached_is_left_to_ray_for_a_while() -> None:
    asked = 0

    async def nowhere() -> str:
        nonlocal asked
        asked += 1
        raise RuntimeError("no router")

    link = AdmissionLink(nowhere)
    with pytest.raises(LinkDown) as e:
        await link.admit_many([ticket("a")])
    assert not e.value.sent  # nothing went out: Ray may carry it
    with pytest.raises(LinkDown):
        await link.admit_many([ticket("b")])
    assert asked == 1  # not asked again before the pause is over
    assert not link.release_many([Release("a", Outcome.OK)])


async def test_a_connection_lost_mid_batch_fails_it_as_sent_then_reconnects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "RECONNECT_PAUSE_S", 0.0)
    router, server, endpoint = await serve()

    async def where() -> str:
        return endpoint

    link = AdmissionLink(where)
    assert (await link.admit_many([ticket("a")]))[0] is not None
    router.hold.clear()
    out = asyncio.ensure_future(link.admit_many([ticket("b")]))
    await until(lambda: len(router.batches) == 2, "the batch in")
    await server.stop()  # the router went away with the batch
    with pytest.raises(LinkDown) as e:
        await out
    assert e.value.sent  # it may have acted on it
    router.hold.set()
    router2, server2, endpoint = await serve()
    assert (await link.admit_many([ticket("c")]))[0] is not None
    assert router2.batches == [["c"]]
    link.close()
    await server2.stop()


async def test_nonsense_on_the_socket_drops_that_connection_only() -> None:
    _router, server, endpoint = await serve()
    host, _, port = endpoint.rpartition(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\x00\x00\x00\x03abc")
    await writer.drain()

    async def where() -> str:
        return endpoint

    link = AdmissionLink(where)
    assert (await link.admit_many([ticket("a")]))[0] is not None
    writer.close()
    link.close()
    await server.stop()


async def test_a_batch_the_router_raises_on_fails_with_its_error_alone() -> None:
    """As over Ray: that batch's callers get the error; the connection and the
    other batches go on."""
    _router, server, endpoint = await serve()

    async def where() -> str:
        return endpoint

    link = AdmissionLink(where)
    with pytest.raises(RouterError, match="could not take it"):
        await link.admit_many([ticket("boom")])
    assert link.up
    assert (await link.admit_many([ticket("a")]))[0] is not None
    link.close()
    await server.stop()
