"""The router's admission socket: the actor's own methods over a TCP connection."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from pathlib import Path
from typing import Any

import pytest

from cluster.qos import QoS
from router import wire
from router.types import Outcome, Release, ReplicaId, RouteDecision, Shed, Ticket
from router.wire import (
    AdmissionLink,
    AdmissionServer,
    LinkDown,
    RouterError,
    WireEndpoint,
)
from tests.tls_certs import use_tls, write_certs
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


async def serve() -> tuple[Router, AdmissionServer, WireEndpoint]:
    router = Router()
    server = AdmissionServer(router.admit_many, router.release_many)
    return router, server, await server.start("127.0.0.1")


async def test_admissions_and_releases_cross_the_socket_whole() -> None:
    router, server, endpoint = await serve()

    async def where() -> WireEndpoint:
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

    async def nowhere() -> WireEndpoint:
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

    async def where() -> WireEndpoint:
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
    host, _, port = endpoint.address.rpartition(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\x00\x00\x00\x03abc")
    await writer.drain()

    async def where() -> WireEndpoint:
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

    async def where() -> WireEndpoint:
        return endpoint

    link = AdmissionLink(where)
    with pytest.raises(RouterError, match="could not take it"):
        await link.admit_many([ticket("boom")])
    assert link.up
    assert (await link.admit_many([ticket("a")]))[0] is not None
    link.close()
    await server.stop()


async def _dropped(reader: asyncio.StreamReader) -> bool:
    """Whether the router closed the connection without an answer."""
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "opening",
    [
        [(0, "hello", "guess")],  # a wrong token
        [(1, "admit", [ticket("a")])],  # none: a batch first
        [(1, "release", [Release("a", Outcome.OK)])],
    ],
    ids=["wrong token", "admit first", "release first"],
)
async def test_a_connection_without_the_token_is_dropped_before_it_is_read(
    opening: list[Any],
) -> None:
    router, server, endpoint = await serve()
    host, _, port = endpoint.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    for frame in [*opening, (2, "admit", [ticket("b")])]:
        writer.write(wire._frame(frame))
    await writer.drain()
    assert await _dropped(reader)
    assert router.batches == [] and router.released == []
    writer.close()
    await server.stop()


async def test_a_stale_token_leaves_the_batch_to_ray() -> None:
    router, server, endpoint = await serve()

    async def stale() -> WireEndpoint:  # another router's token
        return dataclasses.replace(endpoint, token="0" * 32)

    link = AdmissionLink(stale)
    with pytest.raises(LinkDown) as e:
        await link.admit_many([ticket("a")])
    assert not e.value.sent and not link.up  # never sent: Ray may carry it
    assert router.batches == []
    await server.stop()


async def test_under_rays_tls_the_socket_takes_certified_tls_connections_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = use_tls(monkeypatch, tmp_path / "cluster")
    router, server, endpoint = await serve()
    assert endpoint.encrypted

    async def where() -> WireEndpoint:
        return endpoint

    link = AdmissionLink(where)
    assert (await link.admit_many([ticket("a")]))[0] is not None
    assert router.batches == [["a"]]

    host, _, port = endpoint.address.rpartition(":")
    hello = wire._frame((0, "hello", endpoint.token))
    # Plaintext, even with the token: no answer.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(hello + wire._frame((1, "admit", [ticket("b")])))
    assert await _dropped(reader)
    writer.close()
    # TLS without a certificate, or with another CA's: the handshake fails.
    stranger = write_certs(tmp_path / "other", "another-ca")
    for chain in (None, stranger):
        context = ssl.create_default_context(cafile=env["RAY_TLS_CA_CERT"])
        if chain is not None:
            context.load_cert_chain(
                chain["RAY_TLS_SERVER_CERT"], chain["RAY_TLS_SERVER_KEY"]
            )
        with pytest.raises(
            (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)
        ):
            reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
            writer.write(hello + wire._frame((1, "admit", [ticket("c")])))
            await reader.readexactly(1)
    assert router.batches == [["a"]]

    # An ingress whose node has no TLS set up leaves its batches to Ray.
    monkeypatch.delenv("RAY_USE_TLS")
    plain = AdmissionLink(where)
    with pytest.raises(LinkDown, match="RAY_USE_TLS is not set here") as e:
        await plain.admit_many([ticket("d")])
    assert not e.value.sent
    link.close()
    await server.stop()
