"""Replica choice among the replicas that may take a request now.

Every policy returns ``(replica, reason, cached_blocks)`` and breaks ties the same
way (less load, then replica id) so decisions are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.prefix import PrefixView
from router.replicas import Replica
from router.types import Ticket

Choice = tuple[Replica, str, int]


def _least_loaded(candidates: Sequence[Replica]) -> Replica:
    return min(candidates, key=lambda r: (r.load_tokens, r.running, r.replica_id))


class Policy(Protocol):
    name: str

    def choose(self, ticket: Ticket, candidates: Sequence[Replica]) -> Choice: ...


class LeastLoaded:
    """Fewest tokens of work in flight (prompt not yet prefilled + decode left)."""

    name = "least_loaded"

    def choose(self, ticket: Ticket, candidates: Sequence[Replica]) -> Choice:
        return _least_loaded(candidates), "least-loaded", 0


class WeightedRoundRobin:
    """Smooth weighted round robin (nginx's): each replica's share of requests is
    proportional to its measured decode tokens/s; unmeasured replicas weigh as the
    mean of the measured ones (or 1 when none is)."""

    name = "weighted_round_robin"

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def choose(self, ticket: Ticket, candidates: Sequence[Replica]) -> Choice:
        measured = [r.tokens_per_s for r in candidates if r.tokens_per_s > 0]
        default = sum(measured) / len(measured) if measured else 1.0
        weights = {r.replica_id: r.tokens_per_s or default for r in candidates}
        total = sum(weights.values())
        for rid, w in weights.items():
            self._current[rid] = self._current.get(rid, 0.0) + w
        ordered = sorted(candidates, key=lambda r: r.replica_id)
        best = max(ordered, key=lambda r: self._current[r.replica_id])  # ties: first
        self._current[best.replica_id] -= total
        return best, "weighted-rr", 0


class PrefixAware:
    """The replica holding the longest cached prefix of the prompt, unless it is
    more than ``balance_tokens`` busier than the least-loaded one."""

    name = "prefix"

    def __init__(self, view: PrefixView, balance_tokens: int) -> None:
        self._view, self._balance = view, balance_tokens

    def choose(self, ticket: Ticket, candidates: Sequence[Replica]) -> Choice:
        lightest = _least_loaded(candidates)
        cached = self._view.cached_blocks
        hashes = ticket.block_hashes
        hits = {
            r.replica_id: cached(r.replica_id, r.node_id, hashes) for r in candidates
        }
        best = max(candidates, key=lambda r: (hits[r.replica_id], -r.load_tokens))
        if hits[best.replica_id] == 0:
            return lightest, "least-loaded", 0
        if best.load_tokens - lightest.load_tokens > self._balance:
            return lightest, "prefix-overloaded", hits[lightest.replica_id]
        return best, "prefix", hits[best.replica_id]


class ExpertAware:
    """The replica whose experts this prompt hits carry the least predicted load,
    weighted by the prompt's own histogram; ties go to the least loaded."""

    name = "expert"

    def __init__(self, num_experts: int) -> None:
        self._n = num_experts

    def choose(self, ticket: Ticket, candidates: Sequence[Replica]) -> Choice:
        hist = ticket.expert_hist
        total = sum(hist)
        if not total:
            return _least_loaded(candidates), "least-loaded", 0

        def pressure(r: Replica) -> float:
            load = r.expert_load(self._n)
            return sum(n * load[e] for e, n in enumerate(hist) if n) / total

        best = min(candidates, key=lambda r: (pressure(r), r.load_tokens, r.replica_id))
        return best, "expert", 0


POLICIES = ("least_loaded", "weighted_round_robin", "prefix", "expert")
