"""The DeepSeekRouter as a named, restartable Ray actor.

One per application, found by name by every ingress and engine replica. Its state
is soft: after a restart it rebuilds replicas and their running requests from the
next replica reports (every ``report_interval_s``); calls made while it restarts are
retried by Ray (``max_task_retries=-1``). Streams never pass through it, so streams
in flight do not notice it die.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import ray
from opentelemetry.trace import SpanKind

from cluster import gc_pauses, tracing
from cluster.actors import NAMESPACE, kill_and_wait, singleton_options
from cluster.checkpoint import Checkpoint
from cluster.config import RouterConfig
from cluster.loops import every
from router.core import RouterCore
from router.metrics import RouterMetrics
from router.service import RouterService
from router.settings import CoreSettings
from router.shed_log import ShedLog
from router.stats import RouterStats
from router.types import (
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    ReportAck,
    RouteDecision,
    Shed,
    Ticket,
    Transition,
)
from router.wire import AdmissionServer, WireEndpoint

logger = logging.getLogger("moe_cluster.router")
METRICS_INTERVAL_S = 1.0  # gauges from a snapshot this often
LOST_POLL_MAX_S = 30.0  # longest an ingress's lost_replicas call waits
NEWS_POLL_MAX_S = 30.0  # longest an engine replica's news call waits


def actor_name(app_name: str) -> str:
    return f"{app_name}-router"


def num_routed_experts(model_path: str) -> int:
    return Checkpoint.read(model_path).num_routed_experts


class DeepSeekRouter:
    def __init__(
        self, config: RouterConfig, num_experts: int, stores_of: str | None = None
    ) -> None:
        """``stores_of``: the application whose page stores the router follows
        (through its kvstore directory) for what each node's store holds."""
        self.incarnation = uuid.uuid4().hex  # a restart forgets every report
        self._stores_of = stores_of
        self._config = config
        self._metrics = RouterMetrics()
        self._shed_log = ShedLog(logger)
        self._service = RouterService(
            RouterCore(
                CoreSettings.of(config), num_experts=num_experts, clock=time.monotonic
            ),
            on_transition=self._transition,
            on_decision=self._metrics.decision,
        )
        tracing.install("router")
        tracing.install_log_context()
        self._tracer = tracing.tracer()
        self._tasks: list[asyncio.Task[None]] = []
        self._wire: asyncio.Future[WireEndpoint] | None = None  # the admission socket
        # Tickets admit_many left queued, by request id, until ``admission``.
        self._waiting: dict[str, asyncio.Future[RouteDecision | Shed]] = {}
        logger.info("DeepSeekRouter up (policy %s)", config.policy)
        gc_pauses.settle("router")

    async def admit(self, ticket: Ticket) -> RouteDecision | Shed:
        """The decision, or the ``Shed`` refusing it: returned, not raised, so it
        reaches the ingress as itself (Ray wraps what an actor raises)."""
        self._start()
        A = tracing.Attr
        qos = ticket.qos.name.lower()
        tracing.REQUEST_ID.set(ticket.request_id)
        with self._tracer.start_as_current_span(
            "router.admit",
            context=tracing.context_of(dict(ticket.trace)),
            kind=SpanKind.INTERNAL,
            attributes={
                A.QOS: qos,
                A.POLICY: self._config.policy,
                A.PROMPT_TOKENS: ticket.prompt_tokens,
                A.MAX_TOKENS: ticket.max_tokens,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            if ticket.expert_hist:
                span.set_attribute(A.PREDICTED_EXPERTS, _top_experts(ticket))
            try:
                decision = await self._service.admit(ticket)
            except Shed as e:
                self._metrics.shed(ticket.qos, e.reason)
                span.set_attribute(A.SHED_REASON, e.reason)
                span.add_event("shed", {A.SHED_REASON: e.reason, "message": str(e)})
                tracing.fail(span, e, f"shed:{e.reason}")
                self._shed_log.shed(ticket.request_id, qos, e)
                return e
            span.set_attributes(
                {
                    A.REPLICA: decision.replica_id,
                    A.REASON: decision.reason,
                    A.CACHED_BLOCKS: decision.cached_blocks,
                    A.QUEUE_WAIT: decision.queued_s,
                }
            )
        self._metrics.admitted(ticket.qos, decision.queued_s)
        return decision

    async def admit_many(
        self, tickets: list[Ticket]
    ) -> list[RouteDecision | Shed | None]:
        """Admits one ingress's tickets of one moment, in their order: each one's
        decision or ``Shed``, or None while it waits in its class queue (its
        answer then comes from ``admission``). One call instead of one per
        request; the queues, and so the QoS order, are the same."""
        self._start()
        tasks = [asyncio.ensure_future(self.admit(t)) for t in tickets]
        await asyncio.sleep(0)  # each submits, in order; the undelayed finish
        out: list[RouteDecision | Shed | None] = []
        for ticket, task in zip(tickets, tasks, strict=True):
            if task.done():
                out.append(task.result())
            else:
                self._waiting[ticket.request_id] = task
                out.append(None)
        return out

    async def admission(self, request_id: str) -> RouteDecision | Shed | None:
        """The answer for a ticket ``admit_many`` left waiting; None if this
        router holds none (it restarted since: the ingress admits it again).
        Cancelling this call gives the ticket up, as cancelling ``admit`` does."""
        task = self._waiting.get(request_id)
        if task is None:
            return None
        try:
            return await task
        finally:
            self._waiting.pop(request_id, None)

    async def release_many(self, releases: list[Release]) -> None:
        for r in releases:
            await self.release(r)

    async def release(self, release: Release) -> None:
        self._start()
        self._waiting.pop(release.request_id, None)  # given up before it asked
        parent = None
        if release.outcome in (Outcome.FAILED, Outcome.TIMEOUT):
            parent = tracing.context_of(dict(release.trace))
        if parent is None:
            self._service.release(release)
            return
        # A failure gets a span of its own, so that a breaker transition it causes
        # is an event in the request's trace.
        with self._tracer.start_as_current_span(
            "router.release",
            context=parent,
            attributes={
                "moe_cluster.router.outcome": release.outcome.value,
                tracing.Attr.REPLICA: release.replica_id or "",
            },
        ):
            self._service.release(release)

    def _transition(self, t: Transition) -> None:
        self._metrics.transition(t)
        from opentelemetry import trace

        trace.get_current_span().add_event(
            "breaker.transition",
            {"kind": t.kind, "key": t.key, "from": t.old, "to": t.new},
        )

    async def report(self, report: ReplicaReport) -> ReportAck:
        """Merges a replica's report. The answer carries this incarnation's id, so
        a replica can tell that a restarted router needs its whole state again,
        and whether Serve is stopping it."""
        self._start()
        draining = self._service.report(report)
        return ReportAck(self.incarnation, draining, self._service.load())

    async def news(
        self, replica_id: ReplicaId, incarnation: str, draining: bool, wait_s: float
    ) -> tuple[str, bool]:
        """An engine replica's long poll (at most ``wait_s``, capped at
        ``NEWS_POLL_MAX_S``) for what it must report at once rather than at its
        next heartbeat: that this router is not the ``incarnation`` the replica
        last reported to, or that Serve started or stopped draining it. Answers
        this router's incarnation and whether the replica drains.

        A call pending when the router dies is retried by Ray on the restarted
        one, which answers at once: its new incarnation is the news."""
        self._start()
        if incarnation == self.incarnation:
            wait_s = min(wait_s, NEWS_POLL_MAX_S)
            draining = await self._service.draining_changes(
                replica_id, draining, wait_s
            )
        else:
            draining = self._service.draining(replica_id)
        return self.incarnation, draining

    async def serving_changed(
        self, added: list[ReplicaId], removed: list[ReplicaId]
    ) -> None:
        """Serve's running engine replicas changed, as an ingress's request router
        saw it: a removed replica is being stopped and drains."""
        self._start()
        if removed:
            logger.info("replicas stopping, draining: %s", ", ".join(removed))
        self._service.serving_changed(added, removed)

    async def admission_endpoint(self) -> WireEndpoint:
        """Where this router's admission socket (``router.wire``) listens, and
        its token: opened on the first ask, on this node's address."""
        self._start()
        if self._wire is None:
            server = AdmissionServer(self.admit_many, self.release_many)
            host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            self._wire = asyncio.ensure_future(server.start(host))
        return await asyncio.shield(self._wire)

    async def lost_replicas(
        self, since: int, wait_s: float
    ) -> tuple[int, list[ReplicaId]]:
        """Replicas dropped for silence after number ``since`` (a long poll of
        at most ``wait_s``, capped at ``LOST_POLL_MAX_S``): an ingress ends the
        streams it still waits on from them (``RouterService.lost_replicas``)."""
        self._start()
        return await self._service.lost_replicas(since, min(wait_s, LOST_POLL_MAX_S))

    async def close(self) -> int:
        """The cluster is shutting down: every request queued and every new one
        is refused (UNAVAILABLE / 503, with a retry hint); those in flight, and
        their resumptions, go on. Returns how many queued ones it refused."""
        refused = self._service.close()
        logger.warning("closing: new requests are refused (%d queued)", refused)
        return refused

    async def closing(self) -> bool:
        """Whether ``close`` was called: the cluster is stopping."""
        return self._service.core.closing

    async def in_flight(self) -> int:
        """Requests running on the replicas (dispatched, not released)."""
        return self._service.core.in_flight()

    async def snapshot(self) -> RouterStats:
        return self._service.snapshot()

    async def config(self) -> RouterConfig:
        return self._config

    async def reset_stats(self) -> None:
        """Forgets the latency samples in ``snapshot`` (between benchmark phases)."""
        self._service.reset_stats()

    async def ready(self) -> bool:
        self._start()
        return True

    async def follows_stores(self) -> str | None:
        return self._stores_of

    def _start(self) -> None:
        if self._tasks:
            return
        self._service.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._export_metrics()))
        if self._stores_of is not None:
            self._tasks.append(loop.create_task(self._follow_stores(self._stores_of)))

    async def _export_metrics(self) -> None:
        async def step() -> None:
            self._metrics.export(self._service.snapshot())
            self._shed_log.tick()

        await every(
            METRICS_INTERVAL_S, step, what="router metrics export", logger=logger
        )

    async def _follow_stores(self, app: str) -> None:
        """Reads the kvstore directory's change log, as the stores' mirrors do:
        one copy of every node's pages for the whole cluster, however many
        replicas share a node. Every report interval while requests run or the
        log moves; idle, every ``IDLE_SYNC_EVERY`` of them, as an idle store
        publishes."""
        from kvstore import actor as kv_actor

        cursor = ("", -1)  # the directory's incarnation, and its seq read up to
        directory: Any = None
        moved = True  # whether the last read brought changes

        async def step() -> None:
            nonlocal cursor, directory, moved
            try:
                if directory is None:
                    name = kv_actor.directory_name(app)
                    directory = ray.get_actor(name, namespace=NAMESPACE)
                incarnation, changes = await directory.changes.remote(*cursor)
            except ValueError:  # no store has started it yet
                return
            except Exception:  # gone or restarting: all of it again next time
                cursor, directory = ("", -1), None
                raise
            self._service.follow_stores(changes)
            moved = changes.full or bool(changes.added or changes.removed)
            cursor = (incarnation, changes.seq)

        def interval() -> float:
            quiet = not moved and self._service.core.idle()
            slower = kv_actor.IDLE_SYNC_EVERY if quiet else 1
            return self._config.report_interval_s * slower

        await every(
            interval,
            step,
            what="following the kvstore directory",
            logger=logger,
            first_after=0,
        )


def _top_experts(ticket: Ticket, n: int = 8) -> list[int]:
    """The experts the predictor expects this prompt to use most."""
    ranked = sorted(
        range(len(ticket.expert_hist)), key=lambda e: -ticket.expert_hist[e]
    )
    return [e for e in ranked[:n] if ticket.expert_hist[e] > 0]


def get_or_create(
    config: RouterConfig,
    app_name: str,
    model_path: str,
    *,
    follow_stores: bool = False,
    replace: bool = False,
) -> Any:
    """The app's router actor handle, creating the actor if it does not exist yet.
    ``follow_stores``: the app runs page stores, whose pages the router counts as
    cached on every replica of their node.

    With ``replace``, an existing router running another configuration (the app
    was redeployed with a changed ``router`` section, or its stores turned on or
    off) is killed and a new one started; the replicas' next reports rebuild its
    state.
    """
    stores_of = app_name if follow_stores else None
    cls = ray.remote(DeepSeekRouter)
    if replace:
        with contextlib.suppress(ValueError):
            old = ray.get_actor(actor_name(app_name), namespace=NAMESPACE)
            running: Any = ray.get(old.config.remote(), timeout=30)
            followed = ray.get(old.follows_stores.remote(), timeout=30)
            if (running, followed) != (config, stores_of):
                logger.warning("router configuration changed: replacing the router")
                kill_and_wait(old, actor_name(app_name))
    return cls.options(
        **singleton_options(actor_name(app_name), max_concurrency=100_000)
    ).remote(config, num_routed_experts(model_path), stores_of)


def kill(app_name: str) -> None:
    with contextlib.suppress(ValueError):
        ray.kill(
            ray.get_actor(actor_name(app_name), namespace=NAMESPACE), no_restart=True
        )
