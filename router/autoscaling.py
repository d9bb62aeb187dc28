"""QoS-aware autoscaling of engine replicas (or whole EP groups): pure decisions
on the router's view of the load, and the Ray Serve policy that applies them.

The router knows what a replica count cannot show: how long each QoS class has
waited, what its time to first token will be, and how many of the slots the
replicas offer are taken. It sends that view (``LoadSignals.as_metrics``) in its
answer to every replica report; each engine replica hands the last one to Serve
through ``record_autoscaling_stats``, and Serve gives the policy below those
values, aggregated over its look-back window (``ctx.aggregated_metrics``).

``decide`` scales up when realtime or normal traffic would miss its TTFT SLO
(the oldest waiter's wait plus the router's first-token estimate, against the
class's SLO), when the router shed realtime or normal work since the last
decision, or when the slots in use pass ``target_utilization``; background traffic
alone scales up only when its oldest request has waited ``background_max_age_s``.
It scales down, one unit at a time, when nothing waits and the work in flight
would fit in one unit fewer at ``downscale_utilization``. Each direction must hold
for its delay; the count stays within bounds and moves in whole units (an EP
group of ``unit`` ranks). No clock is read here: every call is given ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from cluster.qos import QoS

CLASSES = (QoS.REALTIME, QoS.NORMAL, QoS.BACKGROUND)


@dataclass(frozen=True, slots=True)
class LoadSignals:
    """The router's view of the load, per QoS class where it differs."""

    queued: tuple[int, int, int]  # requests waiting in each class's queue
    oldest_wait_s: tuple[float, float, float]  # the longest wait in each
    ttft_estimate_s: float  # dispatch to first token, measured
    running: tuple[int, int, int]  # requests on serving replicas, per class
    slots: int  # requests the serving replicas may run at once
    serving: int  # replicas that take work (not draining, breaker not open)
    shed: tuple[int, int, int]  # requests refused since the router started

    def as_metrics(self) -> dict[str, float]:
        """Flat numbers, as Serve's ``record_autoscaling_stats`` takes them."""
        out: dict[str, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                for q, v in zip(CLASSES, value, strict=True):
                    out[f"{f.name}_{q.name.lower()}"] = float(v)
            else:
                out[f.name] = float(value)
        return out

    @classmethod
    def from_metrics(cls, m: Mapping[str, float]) -> LoadSignals | None:
        """The inverse of ``as_metrics``; None when a value is missing."""
        try:

            def per_class(name: str) -> Any:
                return tuple(m[f"{name}_{q.name.lower()}"] for q in CLASSES)

            return cls(
                queued=tuple(round(v) for v in per_class("queued")),
                oldest_wait_s=per_class("oldest_wait_s"),
                ttft_estimate_s=float(m["ttft_estimate_s"]),
                running=tuple(round(v) for v in per_class("running")),
                slots=round(m["slots"]),
                serving=round(m["serving"]),
                shed=tuple(round(v) for v in per_class("shed")),
            )
        except KeyError:
            return None


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    """What ``decide`` aims for; every count in replicas (a multiple of ``unit``)."""

    min_replicas: int = 1
    max_replicas: int = 4
    unit: int = 1  # replicas per scaling step: an EP group's ranks
    slo_ttft_s: tuple[float, float] = (0.5, 2.0)  # realtime, normal
    background_max_age_s: float = 60.0
    target_utilization: float = 0.8
    downscale_utilization: float = 0.4
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.unit < 1 or self.min_replicas < self.unit:
            raise ValueError("min_replicas must be at least one unit (EP group)")
        if self.min_replicas % self.unit or self.max_replicas % self.unit:
            raise ValueError("min and max replicas must be whole EP groups")
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        if not 0 < self.downscale_utilization < self.target_utilization <= 1:
            raise ValueError("need 0 < downscale_utilization < target_utilization <= 1")

    def clamp(self, replicas: int) -> int:
        units = math.ceil(replicas / self.unit)
        return min(max(units * self.unit, self.min_replicas), self.max_replicas)


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str  # why (e.g. "realtime_slo", "idle", "hold")
    up_since: float | None = None  # when the current up pressure began
    down_since: float | None = None  # when the current idle stretch began
    shed_seen: int = 0  # realtime and normal requests shed by then


def pressure(
    s: LoadSignals, current: int, p: ScalePolicy, shed_seen: int | None = None
) -> tuple[str, int]:
    """Why more replicas are needed now, and how many in all ("" and ``current``
    when none are). ``shed_seen``: realtime and normal sheds counted before
    (None: unknown); more since is pressure too."""
    per_replica = s.slots / max(s.serving, 1) if s.slots else 0
    running = sum(s.running)
    demand = running + s.queued[0] + s.queued[1]
    # Enough for what runs and waits at the target utilization (at least one
    # unit more than now when a class misses its SLO).
    fit = (
        math.ceil(demand / (per_replica * p.target_utilization))
        if per_replica
        else current + p.unit
    )
    for i, q in enumerate(CLASSES[:2]):
        predicted = s.oldest_wait_s[i] + s.ttft_estimate_s
        if s.queued[i] and predicted > p.slo_ttft_s[i]:
            return f"{q.name.lower()}_slo", max(fit, current + p.unit)
    if shed_seen is not None and s.shed[0] + s.shed[1] > shed_seen:
        # The router refused realtime or normal work (a full queue, a deadline
        # it could not meet): more replicas would have taken it.
        return "shed", max(fit, current + p.unit)
    # Busy slots count once realtime or normal work shares them: background
    # alone scales by the age of its backlog only.
    interactive = s.running[0] + s.running[1] + s.queued[0] + s.queued[1]
    busy = s.slots and running / s.slots > p.target_utilization
    if busy and interactive and fit > current:
        return "utilization", fit
    if s.queued[2] and s.oldest_wait_s[2] > p.background_max_age_s:
        return "background_age", current + p.unit
    return "", current


def idle(s: LoadSignals, current: int, p: ScalePolicy) -> bool:
    """Whether one unit fewer would carry what runs now, with nothing waiting
    (background's backlog younger than its age limit may wait)."""
    if current - p.unit < p.min_replicas or s.queued[0] or s.queued[1]:
        return False
    if s.queued[2] and s.oldest_wait_s[2] > p.background_max_age_s / 2:
        return False
    per_replica = s.slots / max(s.serving, 1) if s.slots else 0
    room = per_replica * (current - p.unit) * p.downscale_utilization
    return sum(s.running) <= room


def decide(
    s: LoadSignals | None,
    current: int,
    previous: Decision | None,
    now: float,
    p: ScalePolicy,
) -> Decision:
    """The replica count for ``now``. ``previous`` carries when the pressure or
    the idle stretch began (``Decision.up_since``/``down_since``)."""
    current = p.clamp(current)
    if s is None:  # no report yet (a new router, no replica has reported)
        return Decision(current, "no_signals")
    up_since = previous.up_since if previous else None
    down_since = previous.down_since if previous else None
    shed = s.shed[0] + s.shed[1]
    # Sheds count from the previous decision; a restarted router counts anew.
    seen = previous.shed_seen if previous and previous.shed_seen <= shed else None
    reason, wanted = pressure(s, current, p, seen)
    if reason:
        up_since = now if up_since is None else up_since
        if now - up_since >= p.upscale_delay_s:
            return Decision(p.clamp(wanted), reason, None, None, shed)
        # Waiting out the delay: the sheds that started it still count.
        kept = previous.shed_seen if previous and seen is not None else shed
        return Decision(current, f"wait:{reason}", up_since, None, kept)
    if idle(s, current, p):
        down_since = now if down_since is None else down_since
        if now - down_since >= p.downscale_delay_s:
            # Start the next idle stretch now: one unit per downscale_delay_s.
            return Decision(p.clamp(current - p.unit), "idle", None, None, shed)
        return Decision(current, "wait:idle", None, down_since, shed)
    return Decision(current, "hold", shed_seen=shed)


# -- Ray Serve ------------------------------------------------------------------

POLICY_FUNCTION = "router.autoscaling:ServePolicy"
_STATE = "moe_cluster"


class ServePolicy:
    """Ray Serve custom autoscaling policy (``AutoscalingPolicy(policy_function=
    POLICY_FUNCTION, policy_kwargs=...)``; Serve builds it once with the kwargs):
    ``decide`` on the replicas' latest router view (the highest of their
    look-back means: every replica relays the same router)."""

    def __init__(self, **kwargs: Any) -> None:
        self.policy = policy_of(kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        latest: dict[str, float] = {}
        for name, by_replica in metrics.items():
            if by_replica:
                latest[name] = max(float(v) for v in by_replica.values())
        signals = LoadSignals.from_metrics(latest)
        state = dict(ctx.policy_state or {})
        mine = state.get(_STATE) or {}
        previous = Decision(
            int(mine.get("replicas", ctx.current_num_replicas)),
            str(mine.get("reason", "")),
            mine.get("up_since"),
            mine.get("down_since"),
            int(mine.get("shed_seen", 0)),
        )
        now = ctx.current_time if ctx.current_time is not None else 0.0
        d = decide(signals, ctx.target_num_replicas, previous, now, self.policy)
        state[_STATE] = {
            "replicas": d.replicas,
            "reason": d.reason,
            "up_since": d.up_since,
            "down_since": d.down_since,
            "shed_seen": d.shed_seen,
        }
        return d.replicas, state


def policy_of(kwargs: Mapping[str, Any]) -> ScalePolicy:
    """A ScalePolicy from JSON policy kwargs (lists for the per-class tuples)."""
    values = dict(kwargs)
    if "slo_ttft_s" in values:
        values["slo_ttft_s"] = tuple(values["slo_ttft_s"])
    return ScalePolicy(**values)
