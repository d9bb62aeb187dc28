"""Per-tenant rate limits: token buckets the router checks before a request queues.

Each tenant has up to two buckets, one counting requests and one counting tokens
(a request's prompt tokens plus its ``max_tokens``, charged when it is admitted).
A bucket refills at its rate up to its burst. A request is admitted when every
bucket of its tenant holds its cost (one request; its tokens), and is charged
that. A request costing more than a bucket's burst is admitted when the bucket is
full and takes it below zero: it is served, and the tenant's next ones wait until
the debt is repaid. A refused request gets the time until its buckets would hold
its cost as its retry hint.

The router is one actor, so the limits are global: a tenant's requests through
every ingress replica draw on the same buckets. A request resumed on another
replica after its engine failed is the same request and is not charged again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

ANY_TENANT = "*"


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's rates (``None``: that bucket is not limited) and bursts."""

    requests_per_s: float | None = None
    request_burst: float = 1.0
    tokens_per_s: float | None = None
    token_burst: float = 1.0

    def __post_init__(self) -> None:
        for rate, burst in (
            (self.requests_per_s, self.request_burst),
            (self.tokens_per_s, self.token_burst),
        ):
            if rate is not None and rate <= 0:
                raise ValueError("a rate must be > 0 (or None: unlimited)")
            if burst <= 0:
                raise ValueError("a burst must be > 0")


class _Bucket:
    __slots__ = ("at", "burst", "level", "rate")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.at = now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
            self.at = now

    def need(self, cost: float) -> float:
        """The level at which a request of ``cost`` is admitted."""
        return min(cost, self.burst)

    def wait_s(self, cost: float) -> float:
        """Seconds until the level reaches ``need(cost)``."""
        return max(0.0, self.need(cost) - self.level) / self.rate

    def full(self) -> bool:
        return self.level >= self.burst


class _Buckets:
    __slots__ = ("requests", "tokens")

    def __init__(self, limit: TenantLimit, now: float) -> None:
        self.requests = (
            None
            if limit.requests_per_s is None
            else _Bucket(limit.requests_per_s, limit.request_burst, now)
        )
        self.tokens = (
            None
            if limit.tokens_per_s is None
            else _Bucket(limit.tokens_per_s, limit.token_burst, now)
        )

    def each(self) -> list[_Bucket]:
        return [b for b in (self.requests, self.tokens) if b is not None]


@dataclass(frozen=True, slots=True)
class Limited:
    """A refusal: which bucket, and seconds until the tenant may send again."""

    what: str  # "requests" or "tokens"
    rate: float
    retry_after_s: float


class TenantRateLimits:
    """The buckets of every tenant. ``limits`` names tenants ("": the default
    tenant); ``"*"`` applies to each tenant not named, each with its own
    buckets. Buckets of tenants under ``"*"`` are forgotten once full again
    (``prune``), so their number stays bounded by the tenants recently active."""

    def __init__(
        self, limits: Mapping[str, TenantLimit], clock: Callable[[], float]
    ) -> None:
        self._limits = dict(limits)
        self._clock = clock
        self._buckets: dict[str, _Buckets] = {}

    def __bool__(self) -> bool:
        return bool(self._limits)

    def _of(self, tenant: str, now: float) -> _Buckets | None:
        buckets = self._buckets.get(tenant)
        if buckets is None:
            limit = self._limits.get(tenant) or self._limits.get(ANY_TENANT)
            if limit is None:
                return None
            buckets = self._buckets[tenant] = _Buckets(limit, now)
        return buckets

    def take(self, tenant: str, tokens: int) -> Limited | None:
        """Charges one request of ``tokens`` to ``tenant``, or refuses it
        (charging nothing) when a bucket does not hold its cost."""
        now = self._clock()
        buckets = self._of(tenant, now)
        if buckets is None:
            return None
        for name, bucket, cost in (
            ("requests", buckets.requests, 1),
            ("tokens", buckets.tokens, tokens),
        ):
            if bucket is None:
                continue
            bucket.refill(now)
            if bucket.level < bucket.need(cost) - 1e-9:
                return Limited(name, bucket.rate, bucket.wait_s(cost))
        if buckets.requests is not None:
            buckets.requests.level -= 1
        if buckets.tokens is not None:
            buckets.tokens.level -= tokens
        return None

    def give_back(self, tenant: str, tokens: int) -> None:
        """Undoes a ``take`` whose request was refused after it (queue full)."""
        buckets = self._buckets.get(tenant)
        if buckets is None:
            return
        if buckets.requests is not None:
            r = buckets.requests
            r.level = min(r.burst, r.level + 1)
        if buckets.tokens is not None:
            t = buckets.tokens
            t.level = min(t.burst, t.level + tokens)

    def prune(self) -> None:
        """Forgets the full buckets of tenants the config does not name."""
        now = self._clock()
        for tenant in [t for t in self._buckets if t not in self._limits]:
            each = self._buckets[tenant].each()
            for b in each:
                b.refill(now)
            if all(b.full() for b in each):
                del self._buckets[tenant]

    def tracked(self) -> int:
        return len(self._buckets)
