"""The DeepSeekRouter's Prometheus metrics (through Ray's metrics agent).

Counters move as things happen (a dispatch, a refusal, a breaker transition, a
decision's compute); gauges are set from ``RouterStats`` snapshots (``export``).
"""

from __future__ import annotations

from ray.util import metrics

from cluster.qos import QoS
from router.stats import RouterStats
from router.types import Transition

QUEUE_WAIT_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]
QUEUE_WAIT_BUCKETS += [10, 30]
_BREAKER_VALUE = {"closed": 0, "half-open": 1, "open": 2, "gone": 3}
_GROUP_BREAKER_VALUE = {"closed": 0, "half-open": 1, "open": 2, "open-normal": 3}


class RouterMetrics:
    def __init__(self) -> None:
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
        self._queue_wait = metrics.Histogram(
            "moe_cluster_router_queue_wait_seconds",
            "Time a dispatched request waited in its class queue.",
            boundaries=QUEUE_WAIT_BUCKETS,
            tag_keys=("qos",),
        )
        self._group_serving = metrics.Gauge(
            "moe_cluster_router_group_serving",
            "1 while every rank of the group reports and none fails, else 0.",
            ("group",),
        )
        self._running = metrics.Gauge(
            "moe_cluster_router_replica_running",
            "Requests the router has running on each replica.",
            ("replica",),
        )
        self._draining = metrics.Gauge(
            "moe_cluster_router_replica_draining",
            "1 while Serve stops the replica (it takes no new work), else 0.",
            ("replica",),
        )
        self._starting = metrics.Gauge(
            "moe_cluster_router_replica_starting",
            "1 while the replica starts (warms up; it takes no work yet), else 0.",
            ("replica",),
        )
        self._ttft_estimate = metrics.Gauge(
            "moe_cluster_router_ttft_estimate_seconds",
            "The router's estimate of a new request's time to first token.",
        )
        self._prefix_hit_rate = metrics.Gauge(
            "moe_cluster_router_prefix_hit_rate",
            "Of the prompt blocks the router placed, the share already held there.",
        )
        self._decision = metrics.Histogram(
            "moe_cluster_router_decision_seconds",
            "Router compute time per dispatched request.",
            boundaries=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
        )

    def admitted(self, qos: QoS, queued_s: float = 0.0) -> None:
        tags = {"qos": qos.name.lower()}
        self._admitted.inc(tags=tags)
        self._queue_wait.observe(queued_s, tags=tags)

    def shed(self, qos: QoS, reason: str) -> None:
        self._shed.inc(tags={"qos": qos.name.lower(), "reason": reason})

    def transition(self, t: Transition) -> None:
        self._transitions.inc(tags={"kind": t.kind, "key": t.key, "to": t.new})
        if t.kind == "replica":
            self._breaker.set(_BREAKER_VALUE.get(t.new, 0), tags={"replica": t.key})
        elif t.kind == "group":
            value = _GROUP_BREAKER_VALUE.get(t.new, 0)
            self._group_breaker.set(value, tags={"group": t.key})

    def decision(self, seconds: float) -> None:
        self._decision.observe(seconds)

    def export(self, stats: RouterStats) -> None:
        """Sets the gauges from a snapshot: queue depths, each replica's breaker
        and running requests, and each group's breaker and measured expert load."""
        for qos, depth in stats.queued.items():
            self._queued.set(depth, tags={"qos": qos})
        for rid, r in stats.replicas.items():
            tags = {"replica": rid}
            self._breaker.set(_BREAKER_VALUE.get(r.breaker, 0), tags=tags)
            self._running.set(r.running, tags=tags)
            self._draining.set(int(r.draining), tags=tags)
            self._starting.set(int(r.starting), tags=tags)
        self._ttft_estimate.set(stats.ttft_estimate_s)
        if stats.prefix_hit_rate is not None:
            self._prefix_hit_rate.set(stats.prefix_hit_rate)
        for group, g in stats.groups.items():
            # No expert breaker configured: the group's is never open.
            value = _GROUP_BREAKER_VALUE.get(g.expert_breaker or "closed", 0)
            self._group_breaker.set(value, tags={"group": group})
            self._group_serving.set(int(g.serving), tags={"group": group})
            if g.window_s <= 0 or not g.expert_tokens:
                continue
            for e, n in enumerate(g.expert_tokens):
                tags = {"group": group, "expert": str(e)}
                self._expert_load.set(n / g.window_s, tags=tags)
            for layer, ratio in g.imbalance.items():
                self._imbalance.set(ratio, tags={"group": group, "layer": str(layer)})
