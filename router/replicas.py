"""The router's view of each engine replica: its leases, load, capacity and breaker.

A lease is a request the router dispatched to a replica (or found running there in
a report). Leases are the router's own bookkeeping; replica reports are the truth
they are reconciled with, which is how a restarted router rebuilds its state.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from router.breakers import ReplicaBreaker
from router.qos import QoS
from router.types import ReplicaId, ReplicaReport


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
    measured_expert_load: tuple[float, ...] = ()
    # Sum of the leases' predicted expert hits, kept as leases come and go.
    _predicted: dict[int, float] = field(default_factory=dict)

    def add(self, lease: Lease) -> None:
        self.remove(lease.request_id)
        self.leases[lease.request_id] = lease
        for e, n in enumerate(lease.expert_hist):
            if n:
                self._predicted[e] = self._predicted.get(e, 0.0) + n

    def remove(self, request_id: str) -> Lease | None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            for e, n in enumerate(lease.expert_hist):
                if n:
                    self._predicted[e] -= n
        return lease

    @property
    def running(self) -> int:
        return len(self.leases)

    @property
    def load_tokens(self) -> int:
        return sum(lease.remaining_tokens for lease in self.leases.values())

    def expert_load(self, num_experts: int) -> list[float]:
        """Predicted tokens in flight per expert; a measured report wins if larger."""
        load = [0.0] * num_experts
        for e, x in self._predicted.items():
            if e < num_experts:
                load[e] = x
        for e, x in enumerate(self.measured_expert_load[:num_experts]):
            load[e] = max(load[e], x)
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
        self.measured_expert_load = report.expert_load
        seen = set()
        for p in report.requests:
            seen.add(p.request_id)
            lease = self.leases.get(p.request_id)
            if lease is None:
                if p.request_id in released:
                    continue  # finished while the report was on its way
                lease = Lease(p.request_id, p.qos, p.prompt_tokens, p.max_tokens, now)
                self.add(lease)
            lease.output_tokens = p.output_tokens
            lease.reported = True
        for rid, lease in list(self.leases.items()):
            late = now - lease.dispatched_at > grace_s
            if rid not in seen and (lease.reported or late):
                self.remove(rid)
