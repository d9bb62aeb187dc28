"""The ingress's batched admissions against a fake router handle."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

import pytest

from cluster.qos import QoS
from deployments.ingress.router_client import RouterClient
from router.types import Outcome, Release, ReplicaId, RouteDecision, Shed, Ticket
from router.wire import AdmissionServer
from tests.waiting import until


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self.count = 0  # calls made through Ray

    def remote(self, *args: Any) -> Any:
        self.count += 1
        return asyncio.ensure_future(self._fn(*args))


class FakeRouter:
    """Decides at once unless a ticket's id starts with "q" (queued until
    ``dispatch``) or "shed"; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.released: list[Release] = []
        self.queued: dict[str, asyncio.Future[RouteDecision | Shed]] = {}
        self.dead_batches = 0
        # lost_replicas answers, in order; an exception is raised.
        self.lost: asyncio.Queue[Any] = asyncio.Queue()
        for name in (
            "admit_many",
            "admission",
            "admit",
            "release",
            "release_many",
            "lost_replicas",
        ):
            setattr(self, name, _Method(getattr(self, "_" + name)))

    def _decide(self, t: Ticket) -> RouteDecision | Shed | None:
        if t.request_id.startswith("shed"):
            return Shed("queue-full", "full", 1.0)
        if t.request_id.startswith("q"):
            self.queued[t.request_id] = asyncio.get_running_loop().create_future()
            return None
        return RouteDecision(ReplicaId("r0"), "least-loaded")

    async def _admit_many(self, tickets: list[Ticket]) -> list[Any]:
        self.calls.append(("admit_many", [t.request_id for t in tickets]))
        if self.dead_batches:
            from ray.exceptions import ActorUnavailableError

            self.dead_batches -= 1
            raise ActorUnavailableError("restarting", None)
        return [self._decide(t) for t in tickets]

    async def _lost_replicas(self, since: int, wait_s: float) -> Any:
        self.calls.append(("lost_replicas", since))
        answer = await self.lost.get()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def _admission(self, rid: str) -> Any:
        self.calls.append(("admission", rid))
        return await self.queued[rid]

    async def _admit(self, t: Ticket) -> Any:
        self.calls.append(("admit", t.request_id))
        return RouteDecision(ReplicaId("r1"), "least-loaded")

    async def _release(self, r: Release) -> None:
        self.released.append(r)

    async def _release_many(self, rs: list[Release]) -> None:
        self.calls.append(("release_many", len(rs)))
        self.released += rs


def ticket(rid: str) -> Ticket:
    return Ticket(rid, QoS.NORMAL, 16, 8)


def client(router: FakeRouter) -> RouterClient:
    """A client that calls the router through Ray only."""
    return RouterClient(lambda: router, None, socket=False)  # type: ignore[arg-type]


def test_one_turns_admissions_and_releases_are_one_call_each() -> None:
    async def run() -> None:
        router = FakeRouter()
        c = client(router)
        decisions = await asyncio.gather(*(c.admit(ticket(f"a{i}")) for i in range(5)))
        assert [d.replica_id for d in decisions] == ["r0"] * 5
        assert router.calls == [("admit_many", [f"a{i}" for i in range(5)])]
        for i in range(5):
            c.release(Release(f"a{i}", Outcome.OK, ReplicaId("r0")))
        await asyncio.sleep(0.01)
        assert router.calls[1:] == [("release_many", 5)]
        assert [r.request_id for r in router.released] == [f"a{i}" for i in range(5)]

    asyncio.run(run())


def test_a_queued_ticket_is_answered_on_its_own_and_sheds_raise() -> None:
    async def run() -> None:
        router = FakeRouter()
        c = client(router)
        queued = asyncio.ensure_future(c.admit(ticket("q1")))
        with pytest.raises(Shed):
            await c.admit(ticket("shed1"))
        await asyncio.sleep(0.01)
        assert ("admission", "q1") in router.calls and not queued.done()
        router.queued["q1"].set_result(RouteDecision(ReplicaId("r2"), "prefix"))
        assert (await queued).replica_id == "r2"

    asyncio.run(run())


def test_an_admission_given_up_while_its_batch_is_out_hands_its_slot_back() -> None:
    async def run() -> None:
        router = FakeRouter()
        c = client(router)
        gone = asyncio.ensure_future(c.admit(ticket("a1")))
        waiting = asyncio.ensure_future(c.admit(ticket("q2")))
        await asyncio.sleep(0)  # both are in the batch being sent
        gone.cancel()
        waiting.cancel()
        await asyncio.sleep(0.01)
        released = {r.request_id: r.outcome for r in router.released}
        assert released == {"a1": Outcome.CANCELLED, "q2": Outcome.CANCELLED}

    asyncio.run(run())


def test_a_batch_the_router_cannot_take_is_admitted_one_by_one() -> None:
    async def run() -> None:
        router = FakeRouter()
        router.dead_batches = 1
        c = client(router)
        decisions = await asyncio.gather(c.admit(ticket("a1")), c.admit(ticket("a2")))
        assert [d.replica_id for d in decisions] == ["r1", "r1"]
        assert ("admit", "a1") in router.calls and ("admit", "a2") in router.calls

    asyncio.run(run())


def test_lost_replicas_are_followed_through_a_router_restart() -> None:
    from ray.exceptions import ActorUnavailableError

    async def run() -> None:
        router = FakeRouter()
        c = client(router)
        told: list[list[str]] = []
        c.watch_lost(told.append)
        c.watch_lost(told.append)  # started once
        for answer in (
            (0, []),  # nothing lost yet: follow from 0
            ActorUnavailableError("restarting", None),
            (1, [ReplicaId("r0")]),
            (3, [ReplicaId("r1"), ReplicaId("r2")]),
        ):
            router.lost.put_nowait(answer)
        await until(lambda: len(told) == 2, "both losses")
        assert told == [["r0"], ["r1", "r2"]]

        def asked() -> list[int]:
            return [since for name, since in router.calls if name == "lost_replicas"]

        # The call after the last answer is made once the loop runs again.
        await until(lambda: len(asked()) >= 5, "the next call")
        assert asked()[:5] == [-1, 0, 0, 1, 3]

    asyncio.run(run())


def test_the_lost_replicas_watch_runs_outside_the_request_that_starts_it() -> None:
    request = contextvars.ContextVar("request", default="")

    async def run() -> None:
        router = FakeRouter()
        seen: list[str] = []

        async def lost_replicas(since: int, wait_s: float) -> Any:
            seen.append(request.get())
            return await asyncio.Event().wait()

        router.lost_replicas = _Method(lost_replicas)  # type: ignore[attr-defined]
        c = client(router)
        request.set("the first request")  # as Serve's request context is set
        c.watch_lost(lambda lost: None)
        await until(lambda: seen, "the watch's call")
        assert seen == [""]

    asyncio.run(run())


def test_batches_take_the_routers_socket_and_ray_while_it_is_down() -> None:
    async def run() -> None:
        router = FakeRouter()
        server = AdmissionServer(router._admit_many, router._release_many)
        endpoint = await server.start("127.0.0.1")

        async def where() -> str:
            return endpoint

        router.admission_endpoint = _Method(where)  # type: ignore[attr-defined]
        c = RouterClient(lambda: router, None)  # type: ignore[arg-type]
        decisions = await asyncio.gather(*(c.admit(ticket(f"a{i}")) for i in range(3)))
        assert [d.replica_id for d in decisions] == ["r0"] * 3
        assert router.calls == [("admit_many", ["a0", "a1", "a2"])]
        c.release(Release("a0", Outcome.OK, ReplicaId("r0")))
        await until(lambda: router.released, "the release")
        assert (router.admit_many.count, router.release_many.count) == (0, 0)
        await server.stop()  # the router restarts: Ray carries the next ones
        await until(lambda: not c._link.up, "the socket closed")  # type: ignore[union-attr]
        assert (await c.admit(ticket("b"))).replica_id == "r0"
        assert router.admit_many.count == 1

    asyncio.run(run())
