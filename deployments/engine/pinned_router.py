"""Serve request router for the engines: send each request where the DeepSeekRouter
placed it.

The DeepSeekRouter already decided admission order and replica; Serve's job is only
delivery. The chosen replica travels in ``EngineRequest.replica_id`` (or in a
``Pin``, for a call without a request). Calls without one (aborts, stats, router
disabled) may go to any replica, and a request whose replica has left the
candidate set (it died, or Serve is stopping it) goes to any other: the ingress
learns where it ran from the stream's ``Started`` event. A replica this handle has
not seen yet has just started: Serve tells the handles a moment after the replica
tells the router, so a request placed there waits for it (``NEW_REPLICA_WAIT_S``)
instead of landing where the router did not put it.

A replica a call to it found dead (Serve's ``on_replica_actor_died``) counts as
gone at once. One found unavailable (``on_replica_actor_unavailable``: what a dead
replica raises over Serve's gRPC transport, or a replica Ray cannot reach for the
moment) gets no request for ``UNAVAILABLE_S``: without this, Serve retried a
request placed on a dead replica there until its controller noticed the death
(3.5 s for a new request's first token after an engine replica was killed).

It is also where the DeepSeekRouter learns that Serve is stopping a replica
(scale-down, redeploy, shutdown): Serve takes a stopping replica out of every
handle's set at once, and this router tells the DeepSeekRouter, which stops
placing work there and tells the replica to drain.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments.protocol import EngineRequest, Pin

logger = logging.getLogger("moe_cluster.ingress")
TELL_TIMEOUT_S = 10.0
# How long a request placed on a replica this handle has not seen yet waits for
# Serve to add it, before it goes to any other.
NEW_REPLICA_WAIT_S = 3.0
# Replicas that left this handle's set, remembered so that a request placed on
# one goes elsewhere at once (it is stopping or dead, not starting).
GONE_REMEMBERED = 256
# How long a replica a call found unavailable gets no request.
UNAVAILABLE_S = 5.0


def target_of(pending: PendingRequest | None) -> str:
    if pending is None or not pending.args:
        return ""
    request: Any = pending.args[0]
    return request.replica_id if isinstance(request, EngineRequest | Pin) else ""


class PinnedRequestRouter(RequestRouter):
    # NOTE: no FIFOMixin: that would hand a freed replica to whichever request
    # waits first, not to the one placed there. The base class matches exactly.

    def initialize_state(self, **kwargs: Any) -> None:
        self._gone: deque[str] = deque(maxlen=GONE_REMEMBERED)
        self._unavailable: dict[str, float] = {}  # replica -> when (monotonic)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = target_of(pending_request)
        if pending_request is not None:
            # Retries (a full replica, one not here yet) back off instead of
            # spinning the event loop.
            pending_request.routing_context.should_backoff = True
        shunned = self._shunned()
        if target and target not in shunned:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
            assert pending_request is not None
            waited = time.time() - pending_request.created_at
            if target not in self._gone and waited < NEW_REPLICA_WAIT_S:
                return []  # just started: Serve adds it to this handle shortly
        # Anywhere: two at random, as Serve's default (it takes the less busy);
        # a fixed order would send every such call to the same replica.
        others = [
            r for r in candidate_replicas if r.replica_id.unique_id not in shunned
        ]
        pool = others or candidate_replicas
        return [random.sample(pool, min(2, len(pool)))]

    def _shunned(self) -> set[str]:
        """Replicas a call found unavailable within ``UNAVAILABLE_S``."""
        if not self._unavailable:
            return set()
        now = time.monotonic()
        for rid, at in list(self._unavailable.items()):
            if now - at > UNAVAILABLE_S:
                del self._unavailable[rid]
        return set(self._unavailable)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._gone.append(replica_id.unique_id)

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self._unavailable[replica_id.unique_id] = time.monotonic()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {rid.unique_id for rid in self.curr_replicas}
        super().update_replicas(replicas)
        now = {r.replica_id.unique_id for r in replicas}
        added, removed = sorted(now - before), sorted(before - now)
        self._gone.extend(removed)
        if added or removed:
            self._event_loop.create_task(self._tell_router(added, removed))

    async def _tell_router(self, added: list[str], removed: list[str]) -> None:
        import ray

        from cluster.actors import NAMESPACE
        from router.actor import actor_name

        try:
            router = await asyncio.to_thread(
                ray.get_actor, actor_name(self.app_name), namespace=NAMESPACE
            )
            await asyncio.wait_for(
                router.serving_changed.remote(added, removed), TELL_TIMEOUT_S
            )
        except Exception as e:  # no router yet (it starts with the first report)
            logger.debug("could not tell the router of %s/%s: %r", added, removed, e)
