"""The router's view of each engine replica: its leases, load, capacity and breaker.

A lease is a request the router dispatched to a replica (or found running there in
a report). Leases are the router's own bookkeeping; replica reports are the truth
they are reconciled with, which is how a restarted router rebuilds its state.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from cluster.qos import QoS
from router.breakers import ReplicaBreaker
from router.types import ExpertLoad, ReplicaId, ReplicaReport


@dataclass(slots=True)
class Lease:
    request_id: str
    qos: QoS
    prompt_tokens: int
    max_tokens: int
    dispatched_at: float
    expert_hist: tuple[int, ...] = ()
    output_tokens: int = 0
    reported: bool = False  # seen in a replica report at least once
    queued_s: float = 0.0  # time it waited in the router's class queue

    @property
    def remaining_tokens(self) -> int:
        """Work left: the prompt until prefilled, then the decode budget left."""
        prefill = self.prompt_tokens if self.output_tokens == 0 else 0
        return prefill + max(self.max_tokens - self.output_tokens, 0)


@dataclass
class Replica:
    replica_id: ReplicaId
    breaker: ReplicaBreaker
    last_report_at: float
    tokens_per_s: float = 0.0
    leases: dict[str, Lease] = field(default_factory=dict)
    measured: ExpertLoad | None = None  # the replica's last measured expert load
    group: str = ""  # EP group ("": the replica is its own group of one)
    group_size: int = 1
    node_id: str = ""  # where it runs ("": unknown, no page store counted)
    draining: bool = False  # Serve is stopping it: no new work, leases finish
    ready: bool = True  # False while it starts (warms up): no work yet
    # Sum of the leases' predicted expert hits, and of their remaining tokens,
    # kept as leases come, progress and go (every placement reads them).
    _predicted: dict[int, float] = field(default_factory=dict)
    _load_tokens: int = 0

    def add(self, lease: Lease) -> None:
        self.remove(lease.request_id)
        self.leases[lease.request_id] = lease
        self._load_tokens += lease.remaining_tokens
        for e, n in enumerate(lease.expert_hist):
            if n:
                self._predicted[e] = self._predicted.get(e, 0.0) + n

    def remove(self, request_id: str) -> Lease | None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self._load_tokens -= lease.remaining_tokens
            for e, n in enumerate(lease.expert_hist):
                if n:
                    self._predicted[e] -= n
        return lease

    def progress(self, lease: Lease, output_tokens: int) -> None:
        """A lease of this replica has ``output_tokens`` out (its report said)."""
        self._load_tokens -= lease.remaining_tokens
        lease.output_tokens = output_tokens
        self._load_tokens += lease.remaining_tokens

    @property
    def running(self) -> int:
        return len(self.leases)

    @property
    def load_tokens(self) -> int:
        """Tokens its leases still have to compute."""
        return self._load_tokens

    @property
    def takes_work(self) -> bool:
        """Ready (started) and not being stopped."""
        return self.ready and not self.draining

    @property
    def group_key(self) -> str:
        return self.group or self.replica_id

    def running_of(self, qos: QoS) -> int:
        return sum(1 for lease in self.leases.values() if lease.qos == qos)

    def expert_load(self, num_experts: int) -> list[float]:
        """Predicted tokens in flight per expert (from the leases' tickets)."""
        load = [0.0] * num_experts
        for e, x in self._predicted.items():
            if e < num_experts:
                load[e] = x
        return load

    def slots_free(self, qos: QoS, slots: int, realtime_reserved: int) -> bool:
        limit = slots + (realtime_reserved if qos == QoS.REALTIME else 0)
        return self.running < limit

    def reconcile(
        self,
        report: ReplicaReport,
        now: float,
        grace_s: float,
        released: Container[str],
    ) -> None:
        """Merges a report: reported requests update (or recreate) leases; a lease
        the replica has not shown for ``grace_s`` since dispatch is gone."""
        self.last_report_at = now
        self.tokens_per_s = report.tokens_per_s
        self.measured = report.expert_load
        self.group, self.group_size = report.group, report.group_size
        self.node_id = report.node_id
        self.ready = report.ready
        seen = set()
        for p in report.requests:
            seen.add(p.request_id)
            lease = self.leases.get(p.request_id)
            if lease is None:
                if p.request_id in released:
                    continue  # finished while the report was on its way
                lease = Lease(p.request_id, p.qos, p.prompt_tokens, p.max_tokens, now)
                self.add(lease)
            self.progress(lease, p.output_tokens)
            lease.reported = True
        for rid, lease in list(self.leases.items()):
            late = now - lease.dispatched_at > grace_s
            if rid not in seen and (lease.reported or late):
                self.remove(rid)
