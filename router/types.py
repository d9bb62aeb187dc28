"""The router's contracts: what the ingress asks, what it is told, what replicas
report."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

from cluster.qos import QoS
from kvstore.block_hash import BlockHash

ReplicaId = NewType("ReplicaId", str)


@dataclass(frozen=True, slots=True)
class Ticket:
    """One request asking to run. Built by the ingress; carries no prompt text."""

    request_id: str
    qos: QoS
    prompt_tokens: int
    max_tokens: int
    deadline_s: float | None = None  # time-to-first-token budget from submission
    block_hashes: tuple[BlockHash, ...] = ()  # the prompt's full blocks, chained
    expert_hist: tuple[int, ...] = ()  # predicted token->expert hits per routed expert
    trace: tuple[tuple[str, str], ...] = ()  # W3C trace context of the request
    tenant: str = ""  # whose rate limits it draws on ("": the default tenant)
    resumed: bool = False  # a stream going on after its engine failed: not charged
    # The replica that just failed (or handed off) this request: it goes to
    # another when one can take it.
    avoid: str = ""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.max_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError("deadline_s must be > 0 when set")


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica_id: ReplicaId
    reason: str  # "least-loaded", "prefix", "expert", "weighted-rr", "half-open-probe"
    cached_blocks: int = 0  # prefix blocks the chosen replica already holds
    queued_s: float = 0.0  # time spent waiting in the router's class queue
    expert_hist: tuple[int, ...] = ()


class Shed(Exception):
    """The router refused a request; the client should retry after ``retry_after_s``."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = (
            reason  # "queue-full", "deadline", "no-replica", "rate-limit", "closing"
        )
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type[Shed], tuple[str, str, float]]:
        return (Shed, (self.reason, str(self), self.retry_after_s))


class Outcome(Enum):
    OK = "ok"
    FAILED = "failed"  # the replica failed the request
    TIMEOUT = "timeout"  # no first token in time after dispatch
    CANCELLED = "cancelled"  # the client went away: not the replica's fault
    REJECTED = "rejected"  # the engine refused the request itself: not its fault
    HANDED_OFF = "handed-off"  # its replica was stopping: resumed elsewhere


@dataclass(frozen=True, slots=True)
class ReportAck:
    """The router's answer to a replica's report."""

    incarnation: str  # changes when the router restarts: resend everything
    draining: bool = False  # Serve is stopping the replica: finish or hand off
    # The router's view of the load (``LoadSignals.as_metrics``), which the
    # replica hands Serve's autoscaler.
    load: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Release:
    """How a dispatched request ended, as the ingress saw it."""

    request_id: str
    outcome: Outcome
    replica_id: ReplicaId | None = None  # where it ran, when known
    ttft_s: float | None = None  # dispatch to first token
    trace: tuple[tuple[str, str], ...] = ()  # W3C trace context of the request


@dataclass(frozen=True, slots=True)
class RequestProgress:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    qos: QoS = QoS.NORMAL


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A replica's prefix-cache change, as vLLM's KV events report it."""

    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """Tokens routed to each expert of each MoE layer over the last ``window_s``
    seconds, as an engine measured them (one token counts once per chosen expert)."""

    layers: tuple[int, ...]  # model layer index of each row
    counts: tuple[tuple[int, ...], ...]  # [layer row][routed expert]
    window_s: float

    @staticmethod
    def merge(loads: list[ExpertLoad]) -> ExpertLoad | None:
        """The sum over ranks (rows matched by layer index)."""
        if not loads:
            return None
        rows: dict[int, list[int]] = {}
        for load in loads:
            for layer, row in zip(load.layers, load.counts, strict=True):
                acc = rows.setdefault(layer, [0] * len(row))
                for e, n in enumerate(row):
                    acc[e] += n
        layers = tuple(sorted(rows))
        return ExpertLoad(
            layers,
            tuple(tuple(rows[layer]) for layer in layers),
            max(load.window_s for load in loads),
        )

    def per_expert(self) -> list[int]:
        """Tokens per expert, summed over layers."""
        total = [0] * (len(self.counts[0]) if self.counts else 0)
        for row in self.counts:
            for e, n in enumerate(row):
                total[e] += n
        return total

    def imbalance(self, min_tokens: int = 1) -> dict[int, float]:
        """Per layer: the busiest expert's tokens over the mean (1.0 = even).
        Layers that routed fewer than ``min_tokens`` are left out (too little
        to judge)."""
        out: dict[int, float] = {}
        for layer, row in zip(self.layers, self.counts, strict=True):
            total = sum(row)
            if row and total >= max(min_tokens, 1):
                out[layer] = max(row) / (total / len(row))
        return out

    def hottest_rate(self) -> float:
        """Tokens per second of the busiest expert in any layer."""
        if self.window_s <= 0 or not self.counts:
            return 0.0
        return max(max(row, default=0) for row in self.counts) / self.window_s


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What a replica sends the router every report interval."""

    replica_id: ReplicaId
    requests: tuple[RequestProgress, ...] = ()
    tokens_per_s: float = 0.0  # generated tokens per second while busy (measured)
    kv_events: tuple[KVEvent, ...] = ()  # its engine's own prefix cache only
    expert_load: ExpertLoad | None = None  # measured, where the engine measures it
    group: str = ""  # expert-parallel group this replica is a rank of ("": none)
    rank: int = 0
    group_size: int = 1
    node_id: str = ""  # the Ray node: its page store's pages are the replica's too
    # False while the replica starts (its engine warms up, Serve has not yet put
    # it in the handles' sets): it reports, but the router places nothing there.
    ready: bool = True


@dataclass(frozen=True, slots=True)
class Transition:
    """A breaker changed state: one metric increment and one log line each."""

    kind: str  # "replica" | "expert"
    key: str
    old: str
    new: str
    at: float
    detail: str = ""


@dataclass
class Counters:
    admitted: dict[QoS, int] = field(default_factory=lambda: dict.fromkeys(QoS, 0))
    shed: dict[tuple[QoS, str], int] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)  # decisions by reason
    # Of the prompts' full blocks placed (hashed tickets only), those the chosen
    # replica held: the prefix policy's hit rate.
    prompt_blocks: int = 0
    cached_blocks: int = 0
