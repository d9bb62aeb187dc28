"""The ingress's side of the DeepSeekRouter actor (``frontend.Admission``).

Admission calls survive a router restart: Ray retries calls in flight on the
restarted actor, and a call refused because the actor is gone is retried here for
``retry_s`` before the client gets UNAVAILABLE. Releases are fire-and-forget: one
lost while the router restarts is reconciled away by the next replica report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from deployments.ingress.errors import EngineUnavailable
from router.tickets import TicketMaker
from router.types import Release, RouteDecision, Shed, Ticket

logger = logging.getLogger("moe_cluster.ingress")
RETRY_PAUSE_S = 0.2


class RouterClient:
    def __init__(
        self,
        connect: Callable[[], Any],
        tickets: TicketMaker,
        retry_s: float = 15.0,
    ) -> None:
        self.tickets = tickets
        self._connect = connect
        self._handle = connect()
        self._retry_s = retry_s

    async def admit(self, ticket: Ticket) -> RouteDecision:
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

    def release(self, release: Release) -> None:
        self._handle.release.remote(release)
