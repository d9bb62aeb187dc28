"""What the router shows of itself: ``RouterStats``, one typed snapshot.

``RouterCore.snapshot`` builds it; the service adds its recent breaker transitions
and decision times; the actor's metrics read it, and ``moe-cluster router`` prints
it (``as_json``). Plain frozen dataclasses: they cross Ray as themselves.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from router.types import Transition


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50 and p99 of some samples (already scaled, e.g. to ms) and their count."""

    p50: float
    p99: float
    n: int

    @staticmethod
    def of(samples: Collection[float], scale: float) -> Percentiles | None:
        """Of ``samples`` times ``scale``; None when there are none."""
        if not samples:
            return None
        p50, p99 = np.percentile(np.fromiter(samples, float), [50, 99]) * scale
        return Percentiles(float(p50), float(p99), len(samples))


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    running: int
    load_tokens: int  # tokens its leases still have to compute
    tokens_per_s: float
    breaker: str  # "closed" | "half-open" | "open"
    cached_blocks: int  # blocks its engine's own prefix cache holds
    node: str  # the Ray node it runs on ("" until it says)
    draining: bool = False  # Serve is stopping it: it takes no new work
    starting: bool = False  # it reports but is not ready: no work yet


@dataclass(frozen=True, slots=True)
class GroupStats:
    """An EP group (or a replica alone, its own group of one)."""

    ranks: tuple[str, ...]
    size: int
    serving: bool  # every rank reporting, none failing
    expert_breaker: str | None
    pressure: float  # measured expert overload, 1.0 at the configured limit
    max_imbalance: float
    imbalance: dict[int, float]  # per MoE layer: busiest expert over the mean
    expert_tokens: tuple[int, ...]  # per expert over the window, summed
    window_s: float


@dataclass(frozen=True, slots=True)
class RouterStats:
    policy: str
    replicas: dict[str, ReplicaStats]
    store_pages: dict[str, int]  # pages each node's store holds
    queued: dict[str, int]  # by class name
    admitted: dict[str, int]  # by class name
    shed: dict[str, int]  # by "class/reason"
    routed: dict[str, int]  # decisions by reason
    prefix_hit_rate: float | None  # of placed prompts' blocks, those held
    ttft_estimate_s: float
    ttft_ms: dict[str, Percentiles | None]  # submission to first token, by class
    dispatch_rate: float | None  # dispatches per second
    hot_experts: tuple[int, ...]
    groups: dict[str, GroupStats]
    transitions: tuple[Transition, ...] = ()  # the latest breaker changes
    decision_us: Percentiles | None = None  # router compute per dispatch

    def with_service(
        self, transitions: tuple[Transition, ...], decision_us: Percentiles | None
    ) -> RouterStats:
        return replace(self, transitions=transitions, decision_us=decision_us)

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values (what ``moe-cluster router`` prints)."""
        out = asdict(self)
        out["transitions"] = [
            {"kind": t.kind, "key": t.key, "old": t.old, "new": t.new, "why": t.detail}
            for t in self.transitions
        ]
        return out
