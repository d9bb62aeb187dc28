"""Per-class queues with weighted fair dispatch, and the wait estimate that sheds.

Dispatch order is stride scheduling over the classes: each class has a pass value
advanced by ``1 / weight`` whenever one of its requests is dispatched, and the
non-empty class with the smallest pass goes next (ties: the more urgent class). With
weights 16:4:1 a saturated cluster gives realtime 16 of every 21 slots that free up,
and background still 1: never starved. A class that was idle rejoins at the current
minimum pass, so idleness earns no burst.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from cluster.qos import QoS
from router.types import Ticket


@dataclass(slots=True)
class Waiting:
    ticket: Ticket
    submitted_at: float
    deadline_at: float | None  # absolute, router clock
    token: int = field(default=0)  # opaque handle for whoever waits on it


class ClassQueues:
    def __init__(self, weights: Mapping[QoS, float], limits: Mapping[QoS, int]) -> None:
        if any(weights[q] <= 0 for q in QoS) or any(limits[q] < 0 for q in QoS):
            raise ValueError("weights must be > 0 and limits >= 0")
        self._weights = dict(weights)
        self._limits = dict(limits)
        self._queues: dict[QoS, deque[Waiting]] = {q: deque() for q in QoS}
        self._pass: dict[QoS, float] = dict.fromkeys(QoS, 0.0)
        self._vtime = 0.0  # pass of the class dispatched last

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def depth(self, qos: QoS) -> int:
        return len(self._queues[qos])

    def full(self, qos: QoS) -> bool:
        return len(self._queues[qos]) >= self._limits[qos]

    def over_limit(self, qos: QoS) -> bool:
        return len(self._queues[qos]) > self._limits[qos]

    def push(self, w: Waiting) -> None:
        q = self._queues[w.ticket.qos]
        if not q:  # rejoin at the current virtual time: idleness earns no credit
            self._pass[w.ticket.qos] = max(self._pass[w.ticket.qos], self._vtime)
        q.append(w)

    def classes_in_order(self) -> list[QoS]:
        """Non-empty classes, the one to serve next first."""
        busy = [q for q in QoS if self._queues[q]]
        return sorted(busy, key=lambda q: (self._pass[q], int(q)))

    def waiting(self, qos: QoS) -> Iterator[Waiting]:
        return iter(list(self._queues[qos]))

    def take(self, w: Waiting) -> None:
        """Removes a dispatched request and charges its class."""
        self._queues[w.ticket.qos].remove(w)
        self._vtime = self._pass[w.ticket.qos]
        self._pass[w.ticket.qos] += 1.0 / self._weights[w.ticket.qos]

    def drop(self, w: Waiting) -> None:
        """Removes a shed or cancelled request (no charge)."""
        self._queues[w.ticket.qos].remove(w)

    def ahead_of_new(self, qos: QoS) -> float:
        """Requests dispatched before a new ``qos`` request would be, under stride
        scheduling with every queue as it is now."""
        mine = len(self._queues[qos]) + 1
        ahead = float(mine - 1)
        for other in QoS:
            if other != qos:
                share = mine * self._weights[other] / self._weights[qos]
                ahead += min(float(len(self._queues[other])), share)
        return ahead


class RateMeter:
    """Events per second over a sliding window (dispatch slots freeing up)."""

    def __init__(self, window_s: float = 10.0, min_events: int = 4) -> None:
        self._window_s, self._min = window_s, min_events
        self._times: deque[float] = deque()

    def add(self, now: float) -> None:
        self._times.append(now)
        self._trim(now)

    def rate(self, now: float) -> float | None:
        """None until enough events to say."""
        self._trim(now)
        if len(self._times) < self._min:
            return None
        span = max(now - self._times[0], 1e-3)
        return (len(self._times) - 1) / span

    def _trim(self, now: float) -> None:
        while self._times and now - self._times[0] > self._window_s:
            self._times.popleft()


class Ewma:
    def __init__(self, alpha: float, initial: float) -> None:
        self.alpha, self.value = alpha, initial
        self.samples = 0

    def add(self, x: float) -> None:
        first = self.samples == 0
        self.value = x if first else self.value + self.alpha * (x - self.value)
        self.samples += 1
