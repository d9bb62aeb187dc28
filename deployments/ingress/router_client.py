"""The ingress's side of the DeepSeekRouter actor (``frontend.Admission``).

Admissions and releases are batched: those an ingress makes in one turn of its
event loop go to the router as one call (``admit_many``, ``release_many``), so
the router's overhead is paid per batch, not per request. The batches travel on
a direct socket to the router (``router.wire``) where it can, and as Ray actor
calls where it cannot (``router.admission_socket`` off, or the socket down).
A ticket the router queues comes back as "waiting" and its answer is asked for
on its own (``admission``, by Ray); cancelling that call gives it up, as
cancelling a single admit does. The router still orders every queued ticket
itself, so QoS order is global.

Admission calls survive a router restart: Ray retries calls in flight on the
restarted actor, and a call refused because the actor is gone is retried here for
``retry_s`` before the client gets UNAVAILABLE. Releases are fire-and-forget: one
lost while the router restarts is reconciled away by the next replica report.

``watch_lost`` follows the replicas the router drops because their reports
stopped (a long poll, one call outstanding per ingress): the ingress then ends
the streams it still waits on from them, long before Ray declares a lost node's
actors dead.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from typing import Any

from deployments.ingress.errors import EngineUnavailable
from router.tickets import TicketMaker
from router.types import Outcome, Release, RouteDecision, Shed, Ticket
from router.wire import AdmissionLink, LinkDown, WireEndpoint

logger = logging.getLogger("moe_cluster.ingress")
RETRY_PAUSE_S = 0.2
LOST_POLL_S = 20.0  # one lost_replicas call waits this long for news


class _Retry:
    """A batch the router could not take: admit this ticket on its own."""


_RETRY = _Retry()
_Answer = RouteDecision | Shed | _Retry | None


class RouterClient:
    def __init__(
        self,
        connect: Callable[[], Any],
        tickets: TicketMaker,
        retry_s: float = 15.0,
        batch: bool = True,
        socket: bool = True,
    ) -> None:
        self.tickets = tickets
        self._connect = connect
        self._handle = connect()
        self._link = AdmissionLink(self._endpoint) if socket and batch else None
        self._retry_s = retry_s
        self._batching = batch
        self._admits: list[tuple[Ticket, asyncio.Future[_Answer]]] = []
        self._releases: list[Release] = []
        self._sending: set[asyncio.Task[None]] = set()
        self._watching: asyncio.Task[None] | None = None

    async def admit(self, ticket: Ticket) -> RouteDecision:
        if not self._batching:
            return await self._admit_one(ticket)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_Answer] = loop.create_future()
        self._admits.append((ticket, fut))
        if len(self._admits) == 1:  # the first of this turn sends them all
            loop.call_soon(self._start_sending)
        answer = await fut
        if isinstance(answer, _Retry):
            return await self._admit_one(ticket)
        if answer is None:  # queued in the router: wait for it on its own
            answer = await self._waiting(ticket)
        if isinstance(answer, Shed):
            raise answer
        assert isinstance(answer, RouteDecision)
        return answer

    async def _waiting(self, ticket: Ticket) -> RouteDecision | Shed:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        try:
            answer: RouteDecision | Shed | None = await self._handle.admission.remote(
                ticket.request_id
            )
        except (ActorDiedError, ActorUnavailableError):
            answer = None
        if answer is None:  # the router restarted and forgot its queue
            return await self._admit_one(ticket)
        return answer

    def _start_sending(self) -> None:
        task = asyncio.get_running_loop().create_task(self._send_admits())
        self._sending.add(task)  # asyncio keeps only a weak reference
        task.add_done_callback(self._sending.discard)

    async def _send_admits(self) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        batch, self._admits = self._admits, []
        tickets = [t for t, _ in batch]
        try:
            answers = await self._admit_many(tickets)
        except (ActorDiedError, ActorUnavailableError):
            answers = [_RETRY] * len(batch)
        except LinkDown:  # after it went out: as if the router had died
            answers = [_RETRY] * len(batch)
        except Exception as e:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (ticket, fut), answer in zip(batch, answers, strict=True):
            if not fut.cancelled():
                fut.set_result(answer)
            elif isinstance(answer, RouteDecision) or answer is None:
                # Given up while the batch was out: hand back the slot it got,
                # or withdraw it from its queue.
                self.release(Release(ticket.request_id, Outcome.CANCELLED))

    async def _admit_many(self, tickets: list[Ticket]) -> list[Any]:
        if self._link is not None:
            try:
                return await self._link.admit_many(tickets)
            except LinkDown as e:
                if e.sent:
                    raise
        answers: list[Any] = await self._handle.admit_many.remote(tickets)
        return answers

    async def _endpoint(self) -> WireEndpoint:
        endpoint: WireEndpoint = await self._handle.admission_endpoint.remote()
        return endpoint

    async def _admit_one(self, ticket: Ticket) -> RouteDecision:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._retry_s
        while True:
            try:
                answer = await self._handle.admit.remote(ticket)
            except (ActorDiedError, ActorUnavailableError) as e:
                if loop.time() > give_up:
                    raise EngineUnavailable(
                        "the router is unavailable; retry"
                    ) from None
                logger.warning("router unavailable (%r); retrying admission", e)
                await asyncio.sleep(RETRY_PAUSE_S)
                if isinstance(e, ActorDiedError):
                    self._handle = await asyncio.to_thread(self._connect)
                continue
            if isinstance(answer, Shed):
                raise answer
            assert isinstance(answer, RouteDecision)
            return answer

    def watch_lost(self, on_lost: Callable[[list[str]], None]) -> None:
        """Calls ``on_lost`` with the replicas the router drops for silence,
        from now on (started once, on the running loop)."""
        if self._watching is None:
            # A context of its own, not the first request's: Serve ties the Ray
            # calls made in a request's context to that request, and cancels
            # them with it (a client that hangs up), which cut the watch's
            # call in flight.
            loop = asyncio.get_running_loop()
            self._watching = loop.create_task(
                self._watch_lost(on_lost), context=contextvars.Context()
            )

    async def _watch_lost(self, on_lost: Callable[[list[str]], None]) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        since = -1  # the router answers with its last number: follow from there
        while True:
            try:
                since, lost = await self._handle.lost_replicas.remote(
                    since, LOST_POLL_S
                )
            except asyncio.CancelledError:
                raise
            except ActorUnavailableError:
                await asyncio.sleep(RETRY_PAUSE_S)  # restarting: ask it again
                continue
            except ActorDiedError:
                # Replaced: the next admission connects to the new one (this
                # loop must not create a router for an app that is stopping).
                await asyncio.sleep(1.0)
                continue
            except Exception as e:
                logger.warning("following lost replicas failed: %r", e)
                await asyncio.sleep(1.0)
                continue
            if lost:
                on_lost([str(r) for r in lost])

    async def closing(self, timeout_s: float) -> bool:
        """Whether the router has closed (the cluster is stopping); False when
        it does not answer in ``timeout_s`` (its restart is not a stop)."""
        try:
            closing: bool = await asyncio.wait_for(
                self._handle.closing.remote(), timeout_s
            )
        except Exception:
            return False
        return closing

    def release(self, release: Release) -> None:
        if not self._batching:
            self._handle.release.remote(release)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the ingress's loop: send it alone
            self._handle.release.remote(release)
            return
        self._releases.append(release)
        if len(self._releases) == 1:
            loop.call_soon(self._send_releases)

    def _send_releases(self) -> None:
        batch, self._releases = self._releases, []
        if self._link is None or not self._link.release_many(batch):
            self._handle.release_many.remote(batch)
