"""``RouterCore`` made awaitable: ``admit`` waits until its request is dispatched or
shed, while a ticker moves time (deadlines, stale replicas, breaker cool-downs).

Plain asyncio, no Ray: the Ray actor wraps one of these, and unit tests drive one
directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from cluster.loops import every
from kvstore.directory import Entry
from kvstore.node_store import Changes
from router.admission import Waiting
from router.core import RouterCore
from router.stats import Percentiles, RouterStats
from router.types import (
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    RouteDecision,
    Shed,
    Ticket,
    Transition,
)

logger = logging.getLogger("moe_cluster.router")
LOST_MEMORY = 256  # replicas dropped for silence that ``lost_replicas`` recalls


class Wakeup:
    """Wakes every long poll waiting on it at once (``fire``); each waits at most
    its own time-out, and one's time-out wakes no other."""

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    async def wait(self, timeout_s: float) -> None:
        """Returns at the next ``fire``, or after ``timeout_s``."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._future), timeout_s)

    def fire(self) -> None:
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_result(None)


class RouterService:
    def __init__(
        self,
        core: RouterCore,
        *,
        tick_s: float = 0.05,
        idle_tick_s: float = 0.5,
        on_transition: Callable[[Transition], None] | None = None,
        on_decision: Callable[[float], None] | None = None,
    ) -> None:
        self.core = core
        self._tick_s, self._idle_tick_s = tick_s, idle_tick_s
        # Set by a request that arrives while the ticker waits its idle interval:
        # its deadline and the breakers it moves are ticked on time again.
        self._wake = asyncio.Event()
        self._ticker_idle = False
        self._futures: dict[int, asyncio.Future[RouteDecision]] = {}
        self._on_transition = on_transition
        self._on_decision = on_decision
        self.decision_s: deque[float] = deque(maxlen=10_000)  # per dispatched request
        self._ticker: asyncio.Task[None] | None = None
        self._queued: dict[str, Waiting] = {}  # request id -> its queue entry
        self.recent_transitions: deque[Transition] = deque(maxlen=100)
        # Replicas dropped because their reports stopped, numbered in order.
        self.lost_epoch = 0
        self._lost: deque[tuple[int, ReplicaId]] = deque(maxlen=LOST_MEMORY)
        self._lost_wakeup = Wakeup()  # a replica dropped: ``lost_replicas``
        self._serving_wakeup = Wakeup()  # Serve's set changed: ``draining_changes``

    def start(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    async def admit(self, ticket: Ticket) -> RouteDecision:
        """Waits for ``ticket``'s dispatch; raises ``Shed`` when it is refused."""
        t0 = time.perf_counter()
        if self._ticker_idle:
            self._ticker_idle = False
            self._wake.set()
        submitted = self.core.submit(ticket)
        # Others it dispatched on the way are delivered even if it was shed.
        self._deliver(list(submitted.dispatched))
        self._drain()
        result = submitted.outcome
        if isinstance(result, Shed):
            raise result
        if isinstance(result, RouteDecision):
            self._decided(time.perf_counter() - t0)
            return result
        fut: asyncio.Future[RouteDecision] = asyncio.get_running_loop().create_future()
        self._futures[result.token] = fut
        self._queued[ticket.request_id] = result
        try:
            return await fut
        except asyncio.CancelledError:
            self._abandon(result, fut)
            raise
        finally:
            self._futures.pop(result.token, None)
            if self._queued.get(ticket.request_id) is result:
                del self._queued[ticket.request_id]

    def _abandon(self, waiting: Waiting, fut: asyncio.Future[RouteDecision]) -> None:
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            # Dispatched just as the caller gave up: hand the slot back.
            self.release(Release(waiting.ticket.request_id, Outcome.CANCELLED))
        else:
            self.core.cancel(waiting)

    def release(self, release: Release) -> None:
        """Ends a dispatched request, or withdraws one still queued."""
        waiting = self._queued.pop(release.request_id, None)
        if waiting is not None:
            self.core.cancel(waiting)
            fut = self._futures.get(waiting.token)
            if fut is not None and not fut.done():
                fut.set_exception(Shed("cancelled", "withdrawn by the ingress", 0.0))
            return
        self.core.release(release)
        self.pump()

    def report(self, report: ReplicaReport) -> bool:
        """Merges a replica's report; returns whether that replica is draining."""
        draining = self.core.report(report)
        self.pump()
        return draining

    def load(self) -> dict[str, float]:
        """The load signals for the autoscaler, as flat metrics."""
        return self.core.load_signals().as_metrics()

    def serving_changed(
        self, added: Iterable[ReplicaId], removed: Iterable[ReplicaId]
    ) -> None:
        """Serve's running replicas changed (see ``RouterCore.serving_changed``)."""
        self.core.serving_changed(added, removed)
        self.pump()
        self._serving_wakeup.fire()

    def draining(self, rid: ReplicaId) -> bool:
        """Whether Serve is stopping replica ``rid`` (what its report's answer says)."""
        return rid in self.core.retired

    async def draining_changes(
        self, rid: ReplicaId, draining: bool, wait_s: float
    ) -> bool:
        """Waits, up to ``wait_s``, for Serve to start stopping replica ``rid``
        (``draining`` False: what the replica last heard) or to keep it after
        all (True); returns whether it drains now."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.draining(rid) == draining:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            await self._serving_wakeup.wait(left)
        return self.draining(rid)

    def follow_stores(self, changes: Changes[Entry]) -> None:
        """What each node's page store holds changed (the kvstore directory's
        change log); placements from now on count it."""
        self.core.follow_stores(changes)

    def pump(self) -> None:
        t0 = time.perf_counter()
        dispatched = self.core.pump()
        if dispatched:
            each = (time.perf_counter() - t0) / len(dispatched)
            for _ in dispatched:
                self._decided(each)
        self._deliver(dispatched)
        self._drain()

    def tick(self) -> None:
        self._refuse(self.core.tick())
        self.pump()

    def close(self) -> int:
        """Refuses every queued and every new request (the cluster is shutting
        down); returns how many were queued."""
        shed = self.core.close()
        self._refuse(shed)
        return len(shed)

    def _refuse(self, shed: list[tuple[Waiting, Shed]]) -> None:
        for waiting, refusal in shed:
            fut = self._futures.get(waiting.token)
            if fut is not None and not fut.done():
                fut.set_exception(refusal)

    async def _run(self) -> None:
        async def step() -> None:
            self.tick()

        def interval() -> float:
            # Idle (nothing queued or in flight, no breaker open), a tick only
            # drops silent replicas: the ticker waits longer, until a request
            # arrives (``admit`` wakes it).
            self._ticker_idle = self.core.idle()
            return self._idle_tick_s if self._ticker_idle else self._tick_s

        await every(interval, step, what="router tick", logger=logger, wake=self._wake)

    def _deliver(self, dispatched: list[tuple[Waiting, RouteDecision]]) -> None:
        for waiting, decision in dispatched:
            fut = self._futures.get(waiting.token)
            if fut is not None and not fut.done():
                fut.set_result(decision)
            else:  # its caller is gone: give the slot back
                self.core.release(Release(waiting.ticket.request_id, Outcome.CANCELLED))

    def _decided(self, seconds: float) -> None:
        self.decision_s.append(seconds)
        if self._on_decision is not None:
            self._on_decision(seconds)

    async def lost_replicas(
        self, since: int, wait_s: float
    ) -> tuple[int, list[ReplicaId]]:
        """The replicas dropped because their reports stopped (their process or
        their node is gone) after number ``since``, and the number of the last;
        waits up to ``wait_s`` for one when there is none yet. A ``since`` this
        service did not give (below 0, or past the last: the router restarted)
        gets the last number and nothing, to follow from."""
        if not 0 <= since <= self.lost_epoch:
            return self.lost_epoch, []
        if since == self.lost_epoch:
            await self._lost_wakeup.wait(wait_s)
        return self.lost_epoch, [rid for n, rid in self._lost if n > since]

    def _replica_lost(self, rid: ReplicaId) -> None:
        self.lost_epoch += 1
        self._lost.append((self.lost_epoch, rid))
        self._lost_wakeup.fire()

    def _drain(self) -> None:
        transitions, self.core.transitions[:] = list(self.core.transitions), []
        for t in transitions:
            if t.kind == "replica" and t.new == "gone":
                self._replica_lost(ReplicaId(t.key))
            self.recent_transitions.append(t)
            logger.warning(
                "%s breaker %s: %s -> %s (%s)", t.kind, t.key, t.old, t.new, t.detail
            )
            if self._on_transition is not None:
                self._on_transition(t)

    def snapshot(self) -> RouterStats:
        return self.core.snapshot().with_service(
            tuple(self.recent_transitions), Percentiles.of(self.decision_s, 1e6)
        )

    def reset_stats(self) -> None:
        """Forgets the latency samples (between benchmark phases)."""
        for samples in self.core.served_ttft.values():
            samples.clear()
        self.decision_s.clear()
