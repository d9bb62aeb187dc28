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
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.util import metrics

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.core import RouterCore
from router.service import RouterService
from router.types import Release, ReplicaReport, RouteDecision, Shed, Ticket, Transition

logger = logging.getLogger("moe_cluster.router")
NAMESPACE = "moe-cluster"
_BREAKER_VALUE = {"closed": 0, "half-open": 1, "open": 2, "gone": 3}
_GROUP_BREAKER_VALUE = {"closed": 0, "half-open": 1, "open": 2, "open-normal": 3}


def actor_name(app_name: str) -> str:
    return f"{app_name}-router"


def num_routed_experts(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("n_routed_experts") or 0)


class DeepSeekRouter:
    def __init__(
        self, config: RouterConfig, num_experts: int, stores_of: str | None = None
    ) -> None:
        """``stores_of``: the application whose page stores the router follows
        (through its kvstore directory) for what each node's store holds."""
        self.incarnation = uuid.uuid4().hex  # a restart forgets every report
        self._stores_of = stores_of
        self._follower: asyncio.Task[None] | None = None
        self._service = RouterService(
            RouterCore(config, num_experts=num_experts, clock=time.monotonic),
            on_transition=self._on_transition,
            on_decision=self._on_decision,
        )
        self._admitted = metrics.Counter(
            "moe_cluster_router_admitted", "Requests dispatched.", ("qos",)
        )
        self._shed = metrics.Counter(
            "moe_cluster_router_shed", "Requests refused.", ("qos", "reason")
        )
        self._transitions = metrics.Counter(
            "moe_cluster_router_breaker_transitions",
            "Breaker state changes.",
            ("kind", "key", "to"),
        )
        self._breaker = metrics.Gauge(
            "moe_cluster_router_replica_breaker",
            "Replica breaker: 0 closed, 1 half-open, 2 open, 3 gone.",
            ("replica",),
        )
        self._queued = metrics.Gauge(
            "moe_cluster_router_queued", "Requests waiting per class.", ("qos",)
        )
        self._group_breaker = metrics.Gauge(
            "moe_cluster_router_group_breaker",
            "Group expert breaker: 0 closed, 1 half-open, 2 open (background "
            "deferred), 3 open for normal too.",
            ("group",),
        )
        self._expert_load = metrics.Gauge(
            "moe_cluster_expert_load_tokens_per_s",
            "Measured tokens routed to each expert per second (rolling window, "
            "summed over MoE layers and the group's ranks).",
            ("group", "expert"),
        )
        self._imbalance = metrics.Gauge(
            "moe_cluster_expert_imbalance",
            "Per MoE layer: the busiest expert's measured tokens over the mean "
            "(1.0 = even).",
            ("group", "layer"),
        )
        self._decision = metrics.Histogram(
            "moe_cluster_router_decision_seconds",
            "Router compute time per dispatched request.",
            boundaries=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
        )
        logger.info("DeepSeekRouter up (policy %s)", config.policy)

    def _on_transition(self, t: Transition) -> None:
        self._transitions.inc(tags={"kind": t.kind, "key": t.key, "to": t.new})
        if t.kind == "replica":
            self._breaker.set(_BREAKER_VALUE.get(t.new, 0), tags={"replica": t.key})
        elif t.kind == "group":
            value = _GROUP_BREAKER_VALUE.get(t.new, 0)
            self._group_breaker.set(value, tags={"group": t.key})

    def _on_decision(self, seconds: float) -> None:
        self._decision.observe(seconds)

    async def admit(self, ticket: Ticket) -> RouteDecision | Shed:
        """The decision, or the ``Shed`` refusing it: returned, not raised, so it
        reaches the ingress as itself (Ray wraps what an actor raises)."""
        self._start()
        try:
            decision = await self._service.admit(ticket)
        except Shed as e:
            self._shed.inc(tags={"qos": ticket.qos.name.lower(), "reason": e.reason})
            return e
        self._admitted.inc(tags={"qos": ticket.qos.name.lower()})
        return decision

    async def release(self, release: Release) -> None:
        self._start()
        self._service.release(release)

    async def report(self, report: ReplicaReport) -> str:
        """Merges a replica's report; returns this incarnation's id, so a replica
        can tell that a restarted router needs its whole state again."""
        self._start()
        self._service.report(report)
        if report.expert_load is not None:
            self._export_expert_load(report.group or report.replica_id)
        for q in QoS:
            depth = self._service.core.queues.depth(q)
            self._queued.set(depth, tags={"qos": q.name.lower()})
        return self.incarnation

    def _export_expert_load(self, group: str) -> None:
        core = self._service.core
        load = core.group_loads.get(group)
        if load is None or load.window_s <= 0:
            return
        for e, n in enumerate(load.per_expert()):
            tags = {"group": group, "expert": str(e)}
            self._expert_load.set(n / load.window_s, tags=tags)
        min_tokens = core.config.expert_min_window_tokens
        for layer, ratio in load.imbalance(min_tokens).items():
            self._imbalance.set(ratio, tags={"group": group, "layer": str(layer)})

    async def snapshot(self) -> dict[str, Any]:
        return self._service.snapshot()

    async def config(self) -> RouterConfig:
        return self._service.core.config

    async def reset_stats(self) -> None:
        """Forgets the latency samples in ``snapshot`` (between benchmark phases)."""
        for samples in self._service.core.served_ttft.values():
            samples.clear()
        self._service.decision_s.clear()

    async def ready(self) -> bool:
        self._start()
        return True

    async def follows_stores(self) -> str | None:
        return self._stores_of

    def _start(self) -> None:
        self._service.start()
        if self._stores_of is not None and self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(
                self._follow_stores(self._stores_of)
            )

    async def _follow_stores(self, app: str) -> None:
        """Reads the kvstore directory's change log, as the stores' mirrors do:
        one copy of every node's pages for the whole cluster, however many
        replicas share a node."""
        from kvstore import actor as kv_actor

        interval = self._service.core.config.report_interval_s
        incarnation, seq = "", -1
        while True:
            try:
                directory = ray.get_actor(
                    kv_actor.directory_name(app), namespace=kv_actor.NAMESPACE
                )
                incarnation, changes = await directory.changes.remote(incarnation, seq)
                self._service.follow_stores(changes)
                seq = changes.seq
            except Exception as e:  # not started yet, or restarting: ask again
                logger.debug("kvstore directory not followed: %r", e)
                incarnation, seq = "", -1
            await asyncio.sleep(interval)


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
                ray.kill(old, no_restart=True)
    return cls.options(
        name=actor_name(app_name),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=100_000,
        num_cpus=0,
        # Not in the caller's placement group (an EP group's gang): it would
        # die with the group and could not be restarted.
        scheduling_strategy="DEFAULT",
    ).remote(config, num_routed_experts(model_path), stores_of)


def kill(app_name: str) -> None:
    with contextlib.suppress(ValueError):
        ray.kill(
            ray.get_actor(actor_name(app_name), namespace=NAMESPACE), no_restart=True
        )
