"""The DeepSeekRouter's decisions: admission, placement, breakers. Pure and clocked.

``RouterCore`` is driven by five calls: ``submit`` (a request asks to run),
``pump`` (dispatch whatever may run now), ``release`` (a request ended),
``report`` (a replica's load) and ``tick`` (time passes: deadlines, stale
replicas, breaker cool-downs). It never blocks and never does I/O; the asyncio
service and the Ray actor around it only wait and deliver.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cluster.qos import QoS
from kvstore.directory import Entry
from kvstore.node_store import Changes
from router.admission import ClassQueues, Ewma, RateMeter, Waiting
from router.autoscaling import CLASSES, LoadSignals
from router.breakers import (
    CLOSED,
    OPEN,
    ExpertBreakers,
    GroupExpertBreaker,
    ReplicaBreaker,
)
from router.policies import (
    ExpertAware,
    LeastLoaded,
    Policy,
    PrefixAware,
    WeightedRoundRobin,
)
from router.prefix import PrefixView
from router.rate_limits import TenantRateLimits
from router.replicas import Lease, Replica
from router.settings import CoreSettings
from router.stats import GroupStats, Percentiles, ReplicaStats, RouterStats
from router.types import (
    Counters,
    ExpertLoad,
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    RouteDecision,
    Shed,
    Ticket,
    Transition,
)

Clock = Callable[[], float]


def expert_pressure(load: ExpertLoad | None, config: CoreSettings) -> float:
    """A group's measured expert overload: 1.0 is at the configured limit."""
    if load is None:
        return 0.0
    pressure = 0.0
    if config.expert_max_imbalance is not None:
        worst = max(load.imbalance(config.expert_min_window_tokens).values(), default=0)
        pressure = max(pressure, worst / config.expert_max_imbalance)
    if config.expert_max_tokens_per_s is not None:
        pressure = max(pressure, load.hottest_rate() / config.expert_max_tokens_per_s)
    return pressure


LEASE_GRACE_S = 3.0  # a dispatched request shows up in its replica's reports by then
RELEASED_MEMORY_S = 10.0
# A stopped replica still reports while it drains; forgotten this long after.
RETIRED_MEMORY_S = 600.0
MIN_RETRY_S, MAX_RETRY_S = 0.5, 30.0
CLOSING_RETRY_S = 1.0  # a refused client retries (on another cluster) after
PRUNE_EVERY_S = 5.0  # full rate-limit buckets of unnamed tenants are forgotten


@dataclass(frozen=True, slots=True)
class Submitted:
    """What ``RouterCore.submit`` did with a ticket: its own ``outcome`` (placed,
    queued, or refused), and the waiting requests it dispatched on the way, whose
    callers are told even when this one is refused."""

    outcome: RouteDecision | Waiting | Shed
    dispatched: tuple[tuple[Waiting, RouteDecision], ...] = ()


class RouterCore:
    def __init__(
        self, config: CoreSettings, *, num_experts: int = 0, clock: Clock
    ) -> None:
        self.config = config
        self._clock = clock
        self._num_experts = num_experts
        self.queues = ClassQueues(
            dict(config.class_weights),
            dict(config.max_queued),
        )
        self.replicas: dict[ReplicaId, Replica] = {}
        # What each replica can serve from cache: its engine's blocks (from its
        # reports) and its node's store pages (``follow_stores``).
        self.prefixes = PrefixView()
        self.directory = self.prefixes.engines
        self.policy = self._make_policy(config)
        self.transitions: list[Transition] = []
        # Submission to first token of recent requests, per class (seconds).
        self.served_ttft: dict[QoS, deque[float]] = {q: deque(maxlen=2000) for q in QoS}
        self.counters = Counters()
        # Requests released in the last RELEASED_MEMORY_S, oldest first: ``tick``
        # forgets them from the front, so its work is what expired, not what
        # is remembered (tens of thousands at thousands of admissions a second).
        self._released: OrderedDict[str, float] = OrderedDict()
        # Replicas Serve has stopped (scale-down, redeploy, shutdown), told by
        # the ingresses' request routers, with when: they drain.
        self.retired: dict[ReplicaId, float] = {}
        self._ttft = Ewma(0.2, config.default_ttft_ms / 1000)
        self._freed = RateMeter()
        self._tokens = itertools.count(1)
        self.group_breakers: dict[str, GroupExpertBreaker] = {}
        # Each group's measured expert load: its ranks' last reports, summed once
        # per report for the breaker, the metrics and the snapshot.
        self.group_loads: dict[str, ExpertLoad] = {}
        self._group_breaking = (
            config.expert_max_imbalance is not None
            or config.expert_max_tokens_per_s is not None
        )
        self.rate_limits = TenantRateLimits(config.tenant_rate_limits, clock)
        # The cluster is shutting down: new requests are refused ("closing"),
        # streams in flight (and their resumptions) go on.
        self.closing = False
        self._pruned_at = clock()
        self.expert_breakers: ExpertBreakers | None = None
        if config.expert_capacity_tokens is not None and num_experts:
            self.expert_breakers = ExpertBreakers(
                num_experts,
                capacity=config.expert_capacity_tokens,
                normal_factor=config.expert_normal_factor,
                close_ratio=config.expert_close_ratio,
                clock=clock,
                emit=self.transitions.append,
            )

    def _make_policy(self, config: CoreSettings) -> Policy:
        if config.policy == "weighted_round_robin":
            return WeightedRoundRobin()
        if config.policy == "prefix":
            return PrefixAware(self.prefixes, config.prefix_balance_tokens)
        if config.policy == "expert":
            return ExpertAware(self._num_experts)
        return LeastLoaded()

    # -- admission -----------------------------------------------------------

    def submit(self, ticket: Ticket) -> Submitted:
        """Dispatches ``ticket`` now, queues it, or refuses it (a ``Shed``
        outcome, returned); the waiting requests it dispatched on the way, in
        pump order, come with it."""
        now = self._clock()
        qos = ticket.qos
        if self.closing and not ticket.resumed:
            return Submitted(self._shed_closing(qos))
        if ticket.deadline_s is not None and ticket.deadline_s < self._ttft.value:
            return Submitted(
                self._shed(
                    qos,
                    "deadline",
                    f"deadline_ms={ticket.deadline_s * 1000:.0f} is shorter than the "
                    f"expected time to first token ({self._ttft.value * 1000:.0f} ms)",
                )
            )
        cost = ticket.prompt_tokens + ticket.max_tokens
        charged = bool(self.rate_limits) and not ticket.resumed
        if charged and (limited := self.rate_limits.take(ticket.tenant, cost)):
            return Submitted(
                self._shed(
                    qos,
                    "rate-limit",
                    f"tenant {ticket.tenant or '(default)'} is over its limit of "
                    f"{limited.rate:g} {limited.what}/s; retry later",
                    max(round(limited.retry_after_s, 2), 0.01),
                )
            )
        deadline_at = None if ticket.deadline_s is None else now + ticket.deadline_s
        waiting = Waiting(ticket, now, deadline_at, next(self._tokens))
        # What a deadline is checked against, as things stand before it queues.
        estimate = self.expected_wait(qos) if deadline_at is not None else 0.0
        self.queues.push(waiting)
        mine: RouteDecision | None = None
        others: list[tuple[Waiting, RouteDecision]] = []
        for w, decision in self.pump():
            if w is waiting:
                mine = decision
            else:
                others.append((w, decision))
        dispatched = tuple(others)
        if mine is not None:
            return Submitted(mine, dispatched)
        if self.queues.over_limit(qos):  # it must wait, and its queue has no room
            self._withdraw(waiting, cost if charged else None)
            return Submitted(
                self._shed(
                    qos,
                    "queue-full",
                    f"the {qos.name.lower()} queue is full "
                    f"({self.queues.depth(qos)} waiting); retry later",
                ),
                dispatched,
            )
        if deadline_at is not None and now + estimate + self._ttft.value > deadline_at:
            self._withdraw(waiting, cost if charged else None)
            return Submitted(
                self._shed(
                    qos,
                    "deadline",
                    f"expected wait {estimate * 1000:.0f} ms plus time to first "
                    f"token exceeds deadline_ms={ticket.deadline_s * 1000:.0f}",  # type: ignore[operator]
                    max(estimate, MIN_RETRY_S),
                ),
                dispatched,
            )
        return Submitted(waiting, dispatched)

    def _withdraw(self, waiting: Waiting, charged: int | None) -> None:
        """Takes back a request just queued and then refused; gives its tenant
        back the ``charged`` tokens (and the request) it was charged."""
        self.queues.drop(waiting)
        if charged is not None:
            self.rate_limits.give_back(waiting.ticket.tenant, charged)

    def expected_wait(self, qos: QoS) -> float:
        """Seconds a new ``qos`` request would wait for dispatch (0 if unknown)."""
        now = self._clock()
        if self.queues.depth(qos) == 0 and self._candidates(qos):
            return 0.0
        rate = self._freed.rate(now)
        if rate is None:
            return 0.0
        return self.queues.ahead_of_new(qos) / rate

    def retry_after(self, qos: QoS) -> float:
        rate = self._freed.rate(self._clock())
        if rate is None:
            return 1.0
        wait = self.queues.ahead_of_new(qos) / rate
        return min(max(wait, MIN_RETRY_S), MAX_RETRY_S)

    def cancel(self, waiting: Waiting) -> None:
        """The caller gave up on a queued request."""
        if waiting in self.queues.waiting(waiting.ticket.qos):
            self.queues.drop(waiting)

    def pump(self) -> list[tuple[Waiting, RouteDecision]]:
        """Dispatches queued requests, in weighted fair order, while replicas have
        room. A request an expert breaker defers is skipped, not blocking others."""
        out: list[tuple[Waiting, RouteDecision]] = []
        expert_load = self._expert_load() if self.expert_breakers else None
        blocked: set[QoS] = set()
        while True:
            progressed = False
            for qos in self.queues.classes_in_order():
                if qos in blocked:
                    continue
                candidates = self._candidates(qos)
                if not candidates:
                    blocked.add(qos)
                    continue
                for w in self.queues.waiting(qos):
                    if self.expert_breakers and self.expert_breakers.defers(
                        qos, w.ticket.expert_hist
                    ):
                        continue
                    out.append((w, self._dispatch(w, candidates)))
                    if expert_load is not None and self.expert_breakers:
                        for e, n in enumerate(w.ticket.expert_hist):
                            expert_load[e] += n
                        self.expert_breakers.update(expert_load)
                    progressed = True
                    break
                if progressed:
                    break
            if not progressed:
                return out

    def _candidates(self, qos: QoS) -> list[Replica]:
        slots, reserved = (
            self.config.max_running_per_replica,
            self.config.realtime_reserved_slots,
        )
        out: list[Replica] = []
        serving: dict[str, bool] = {}  # group -> whether it takes ``qos``
        groups: dict[str, list[Replica]] | None = None  # built if any is grouped
        for r in self.replicas.values():
            if not (
                r.takes_work
                and r.breaker.allows()
                and r.slots_free(qos, slots, reserved)
            ):
                continue
            key = r.group_key
            if not r.group and r.group_size <= 1 and key not in self.group_breakers:
                out.append(r)  # a group of one that takes work: it serves
                continue
            serves = serving.get(key)
            if serves is None:
                if r.group:
                    groups = self.groups() if groups is None else groups
                    ranks = groups[key]
                else:
                    ranks = [r]
                serves = serving[key] = self._group_serves(ranks, qos)
            if serves:
                out.append(r)
        return out

    def groups(self) -> dict[str, list[Replica]]:
        """Replicas by EP group (a replica outside any group is its own)."""
        out: dict[str, list[Replica]] = {}
        for r in self.replicas.values():
            out.setdefault(r.group_key, []).append(r)
        return out

    def _group_serves(self, ranks: list[Replica], qos: QoS) -> bool:
        """A group takes work only whole: every rank reporting and ready, none of
        them failing (one dead rank stops the group) or stopping, and its expert
        breaker allowing ``qos``."""
        whole = len(ranks) >= ranks[0].group_size
        if not whole or any(r.breaker.state == OPEN or not r.takes_work for r in ranks):
            return False
        breaker = self.group_breakers.get(ranks[0].group_key)
        if breaker is None:
            return True
        background = sum(r.running_of(QoS.BACKGROUND) for r in ranks)
        return not breaker.defers(qos, background)

    def _merge_group_load(self, group: str) -> None:
        """Sums the group's ranks' last measured loads; moves its breaker."""
        loads = [
            r.measured
            for r in self.replicas.values()
            if r.group_key == group and r.measured is not None
        ]
        merged = ExpertLoad.merge(loads)
        if merged is None:
            self.group_loads.pop(group, None)
        else:
            self.group_loads[group] = merged
        if not self._group_breaking:
            return
        breaker = self.group_breakers.get(group)
        if breaker is None:
            breaker = self.group_breakers[group] = GroupExpertBreaker(
                group,
                normal_factor=self.config.expert_normal_factor,
                close_ratio=self.config.expert_close_ratio,
                probe_s=self.config.expert_probe_s,
                clock=self._clock,
                emit=self.transitions.append,
            )
        breaker.update(expert_pressure(merged, self.config))

    def _dispatch(self, w: Waiting, candidates: list[Replica]) -> RouteDecision:
        t = w.ticket
        if t.avoid:  # not back to the replica it failed on, while another has room
            candidates = [
                r for r in candidates if r.replica_id != t.avoid
            ] or candidates
        replica, reason, cached = self.policy.choose(t, candidates)
        if replica.breaker.on_dispatch():
            reason = "half-open-probe"
        now = self._clock()
        replica.add(
            Lease(
                t.request_id,
                t.qos,
                t.prompt_tokens,
                t.max_tokens,
                now,
                t.expert_hist,
                queued_s=now - w.submitted_at,
            )
        )
        self.queues.take(w)
        c = self.counters
        c.admitted[t.qos] += 1
        c.routed[reason] = c.routed.get(reason, 0) + 1
        if t.block_hashes:
            c.prompt_blocks += len(t.block_hashes)
            c.cached_blocks += cached
        return RouteDecision(
            replica.replica_id, reason, cached, now - w.submitted_at, t.expert_hist
        )

    # -- feedback ------------------------------------------------------------

    def release(self, release: Release) -> None:
        now = self._clock()
        rid = release.request_id
        self._released[rid] = now
        self._released.move_to_end(rid)  # released again: forgotten from now
        holder = self._holder_of(rid, release.replica_id)
        lease = holder.remove(rid) if holder is not None else None
        self._freed.add(now)
        if release.ttft_s is not None:
            self._ttft.add(release.ttft_s)
            if lease is not None:
                self.served_ttft[lease.qos].append(lease.queued_s + release.ttft_s)
        # Blame where it ran (Serve may have moved it), else where it was placed.
        rid_ran = release.replica_id
        blamed = self.replicas.get(rid_ran) if rid_ran else holder
        if blamed is None:
            return  # a replica the router no longer (or not yet) knows
        if release.outcome is Outcome.OK:
            blamed.breaker.record(True)
        elif release.outcome in (Outcome.FAILED, Outcome.TIMEOUT):
            blamed.breaker.record(False)
        else:
            blamed.breaker.abandon_probe()

    def report(self, report: ReplicaReport) -> bool:
        """Merges a replica's report; returns whether that replica is draining."""
        now = self._clock()
        replica = self.replicas.get(report.replica_id)
        if replica is None:
            replica = Replica(
                report.replica_id,
                ReplicaBreaker(
                    report.replica_id,
                    failures=self.config.breaker_failures,
                    open_s=self.config.breaker_open_s,
                    clock=self._clock,
                    emit=self.transitions.append,
                ),
                now,
            )
            self.replicas[report.replica_id] = replica
        replica.reconcile(report, now, LEASE_GRACE_S, self._released)
        replica.draining = report.replica_id in self.retired
        self.directory.apply(report.replica_id, report.kv_events)
        self._merge_group_load(replica.group_key)
        return replica.draining

    def serving_changed(
        self, added: Iterable[ReplicaId], removed: Iterable[ReplicaId]
    ) -> None:
        """Serve's set of running replicas changed. A removed replica is being
        stopped: it takes no new work, and its leases finish or are handed off
        (it learns so from the answer to its next report). One that comes back
        is no longer draining. Call ``pump`` after."""
        now = self._clock()
        for rid in removed:
            self.retired[rid] = now
            if (replica := self.replicas.get(rid)) is not None:
                replica.draining = True
        for rid in added:
            self.retired.pop(rid, None)
            if (replica := self.replicas.get(rid)) is not None:
                replica.draining = False

    def follow_stores(self, changes: Changes[Entry]) -> None:
        """The kvstore directory's changes since the last call: which node's page
        store holds which page (``full``: everything, after either restarted)."""
        self.prefixes.follow_stores(changes)

    def close(self) -> list[tuple[Waiting, Shed]]:
        """The cluster is shutting down: refuses every request queued and every
        new one; those dispatched run on."""
        self.closing = True
        shed = []
        for qos in QoS:
            for w in list(self.queues.waiting(qos)):
                self.queues.drop(w)
                shed.append((w, self._shed_closing(qos)))
        return shed

    def _shed_closing(self, qos: QoS) -> Shed:
        return self._shed(
            qos, "closing", "the cluster is shutting down; retry", CLOSING_RETRY_S
        )

    def in_flight(self) -> int:
        """Requests dispatched and not yet released, on every replica."""
        return sum(len(r.leases) for r in self.replicas.values())

    def idle(self) -> bool:
        """Nothing queued, nothing in flight, no breaker open: nothing ``tick``
        does can change an outcome before the next request or report, except
        dropping a silent replica (``replica_stale_s``, seconds)."""
        return (
            not self.queues
            and self.in_flight() == 0
            and not (self.expert_breakers and self.expert_breakers.hot())
            and all(b.state == CLOSED for b in self.group_breakers.values())
        )

    def tick(self) -> list[tuple[Waiting, Shed]]:
        """Drops silent replicas and sheds queued requests that can no longer meet
        their deadline (or waited ``max_wait_s``). Call ``pump`` after."""
        now = self._clock()
        for rid, replica in list(self.replicas.items()):
            if now - replica.last_report_at > self.config.replica_stale_s:
                del self.replicas[rid]
                self.directory.forget(rid)
                self.transitions.append(
                    Transition(
                        "replica", rid, replica.breaker.state, "gone", now, "no report"
                    )
                )
        if self.rate_limits and now - self._pruned_at > PRUNE_EVERY_S:
            self.rate_limits.prune()
            self._pruned_at = now
        released = self._released
        while released and now - next(iter(released.values())) > RELEASED_MEMORY_S:
            released.popitem(last=False)
        for rid, at in list(self.retired.items()):
            if now - at > RETIRED_MEMORY_S and rid not in self.replicas:
                del self.retired[rid]
        live = self.groups()
        for group in list(self.group_loads):
            if group not in live:
                del self.group_loads[group]
        for group, breaker in list(self.group_breakers.items()):
            if group in live:
                breaker.update(breaker.pressure)  # time passes: half-open closes
            else:
                del self.group_breakers[group]
        if self.expert_breakers:
            self.expert_breakers.update(self._expert_load())
        shed: list[tuple[Waiting, Shed]] = []
        for qos in QoS:
            for w in self.queues.waiting(qos):
                if w.deadline_at is not None and now + self._ttft.value > w.deadline_at:
                    reason, msg = "deadline", "the deadline can no longer be met"
                elif now - w.submitted_at > self.config.max_wait_s:
                    reason, msg = "queue-timeout", "waited too long for a replica"
                else:
                    continue
                self.queues.drop(w)
                shed.append((w, self._shed(qos, reason, msg)))
        return shed

    def _holder_of(self, request_id: str, hint: ReplicaId | None) -> Replica | None:
        """The replica holding ``request_id``'s lease (``hint`` is looked at first)."""
        first = self.replicas.get(hint) if hint is not None else None
        if first is not None and request_id in first.leases:
            return first
        for r in self.replicas.values():
            if request_id in r.leases:
                return r
        return None

    def _expert_load(self) -> list[float]:
        load = [0.0] * self._num_experts
        for r in self.replicas.values():
            for e, x in enumerate(r.expert_load(self._num_experts)):
                load[e] += x
        return load

    def _group_stats(self, group: str, ranks: list[Replica]) -> GroupStats:
        load = self.group_loads.get(group)
        breaker = self.group_breakers.get(group)
        imbalance = load.imbalance(self.config.expert_min_window_tokens) if load else {}
        return GroupStats(
            ranks=tuple(sorted(r.replica_id for r in ranks)),
            size=ranks[0].group_size,
            serving=self._group_serves(ranks, QoS.REALTIME),
            expert_breaker=breaker.state if breaker else None,
            pressure=round(expert_pressure(load, self.config), 3),
            max_imbalance=round(max(imbalance.values(), default=0.0), 3),
            imbalance=imbalance,
            expert_tokens=tuple(load.per_expert()) if load else (),
            window_s=load.window_s if load else 0.0,
        )

    def _shed(
        self, qos: QoS, reason: str, message: str, retry_s: float | None = None
    ) -> Shed:
        """Counts a refusal and returns it (retry hint: the class's expected wait)."""
        key = (qos, reason)
        self.counters.shed[key] = self.counters.shed.get(key, 0) + 1
        return Shed(
            reason, message, self.retry_after(qos) if retry_s is None else retry_s
        )

    def load_signals(self) -> LoadSignals:
        """The load as the autoscaler sees it (``router.autoscaling``)."""
        now = self._clock()
        waits = []
        for q in CLASSES:
            oldest = next(self.queues.waiting(q), None)
            waits.append(now - oldest.submitted_at if oldest else 0.0)
        serving = [
            r for r in self.replicas.values() if r.takes_work and r.breaker.allows()
        ]
        return LoadSignals(
            queued=tuple(self.queues.depth(q) for q in CLASSES),  # type: ignore[arg-type]
            oldest_wait_s=tuple(waits),  # type: ignore[arg-type]
            ttft_estimate_s=self._ttft.value,
            running=tuple(  # type: ignore[arg-type]
                sum(r.running_of(q) for r in serving) for q in CLASSES
            ),
            slots=len(serving) * self.config.max_running_per_replica,
            serving=len(serving),
            shed=tuple(  # type: ignore[arg-type]
                sum(n for (q, _), n in self.counters.shed.items() if q == c)
                for c in CLASSES
            ),
        )

    def snapshot(self) -> RouterStats:
        now = self._clock()
        c = self.counters
        return RouterStats(
            policy=self.policy.name,
            replicas={
                rid: ReplicaStats(
                    running=r.running,
                    load_tokens=r.load_tokens,
                    tokens_per_s=r.tokens_per_s,
                    breaker=r.breaker.state,
                    cached_blocks=self.directory.num_blocks(rid),
                    node=r.node_id,
                    draining=r.draining,
                    starting=not r.ready,
                )
                for rid, r in sorted(self.replicas.items())
            },
            store_pages=self.prefixes.stores.summary(),
            queued={q.name.lower(): self.queues.depth(q) for q in QoS},
            admitted={q.name.lower(): n for q, n in c.admitted.items()},
            shed={f"{q.name.lower()}/{why}": n for (q, why), n in c.shed.items()},
            routed=dict(c.routed),
            prefix_hit_rate=(
                c.cached_blocks / c.prompt_blocks if c.prompt_blocks else None
            ),
            ttft_estimate_s=self._ttft.value,
            ttft_ms={
                q.name.lower(): Percentiles.of(self.served_ttft[q], 1e3) for q in QoS
            },
            dispatch_rate=self._freed.rate(now),
            hot_experts=(
                tuple(self.expert_breakers.hot()) if self.expert_breakers else ()
            ),
            groups={
                group: self._group_stats(group, ranks)
                for group, ranks in sorted(self.groups().items())
            },
        )
