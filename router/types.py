"""The router's contracts: what the ingress asks, what it is told, what replicas
report."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

from router.qos import QoS

ReplicaId = NewType("ReplicaId", str)
BlockHash = NewType("BlockHash", bytes)  # vLLM's chained prefix hash of one full block


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
        self.reason = reason  # "queue-full", "deadline", "no-replica"
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type[Shed], tuple[str, str, float]]:
        return (Shed, (self.reason, str(self), self.retry_after_s))


class Outcome(Enum):
    OK = "ok"
    FAILED = "failed"  # the replica failed the request
    TIMEOUT = "timeout"  # no first token in time after dispatch
    CANCELLED = "cancelled"  # the client went away: not the replica's fault


@dataclass(frozen=True, slots=True)
class Release:
    """How a dispatched request ended, as the ingress saw it."""

    request_id: str
    outcome: Outcome
    replica_id: ReplicaId | None = None  # where it ran, when known
    ttft_s: float | None = None  # dispatch to first token


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
class ReplicaReport:
    """What a replica sends the router every report interval."""

    replica_id: ReplicaId
    requests: tuple[RequestProgress, ...] = ()
    tokens_per_s: float = 0.0  # generated tokens per second while busy (measured)
    kv_events: tuple[KVEvent, ...] = ()
    expert_load: tuple[float, ...] = ()  # measured tokens per routed expert, if any


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
