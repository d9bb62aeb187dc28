"""Circuit breakers: one per replica (failures), one per routed expert (load).

Both take an injected clock and report every state change through ``emit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cluster.qos import QoS
from router.types import Transition

Clock = Callable[[], float]
Emit = Callable[[Transition], None]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"
DEFER_NORMAL = "open-normal"  # a group breaker open for normal requests too


class ReplicaBreaker:
    """``failures`` consecutive failures or timeouts open it; after ``open_s`` it is
    half-open and lets one probe through; the probe's success closes it, its failure
    opens it again for another ``open_s``."""

    def __init__(
        self, key: str, *, failures: int, open_s: float, clock: Clock, emit: Emit
    ) -> None:
        if failures < 1 or open_s <= 0:
            raise ValueError("failures must be >= 1 and open_s > 0")
        self.key, self._failures, self._open_s = key, failures, open_s
        self._clock, self._emit = clock, emit
        self._state = CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_out = False

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self._open_s:
            self._move(HALF_OPEN, "cool-down over")
            self._probe_out = False
        return self._state

    def allows(self) -> bool:
        """May a request be dispatched to this replica now?"""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._probe_out)

    def on_dispatch(self) -> bool:
        """Records a dispatch; True when it is the half-open probe."""
        if self.state == HALF_OPEN:
            self._probe_out = True
            return True
        return False

    def abandon_probe(self) -> None:
        """The probe ended without a verdict (the client went away): allow another."""
        self._probe_out = False

    def record(self, ok: bool) -> None:
        state = self.state
        if ok:
            self._consecutive = 0
            if state == HALF_OPEN:
                self._move(CLOSED, "probe succeeded")
            return
        self._consecutive += 1
        if state == HALF_OPEN:
            self._open("probe failed")
        elif state == CLOSED and self._consecutive >= self._failures:
            self._open(f"{self._consecutive} consecutive failures")

    def _open(self, why: str) -> None:
        self._opened_at = self._clock()
        self._probe_out = False
        self._move(OPEN, why)

    def _move(self, new: str, why: str) -> None:
        old, self._state = self._state, new
        self._emit(Transition("replica", self.key, old, new, self._clock(), why))


class ExpertBreakers:
    """Per routed expert: above ``capacity`` tokens in flight, background requests
    that hit the expert are deferred; above ``capacity * normal_factor`` normal ones
    too. Realtime always runs. A level drops once load falls below
    ``close_ratio`` of its threshold (hysteresis, so it does not flap)."""

    LEVELS = (CLOSED, "defer-background", "defer-normal")

    def __init__(
        self,
        num_experts: int,
        *,
        capacity: float,
        normal_factor: float,
        close_ratio: float,
        clock: Clock,
        emit: Emit,
    ) -> None:
        if capacity <= 0 or normal_factor < 1 or not 0 < close_ratio <= 1:
            raise ValueError("bad expert breaker thresholds")
        self._thresholds = (capacity, capacity * normal_factor)
        self._close_ratio = close_ratio
        self._clock, self._emit = clock, emit
        self.levels = [0] * num_experts

    def update(self, load: Sequence[float]) -> None:
        """Moves each expert's level for its current load (tokens in flight)."""
        for e, x in enumerate(load):
            level = self.levels[e]
            new = level
            while new < 2 and x > self._thresholds[new]:
                new += 1
            while new > 0 and x < self._thresholds[new - 1] * self._close_ratio:
                new -= 1
            if new != level:
                self.levels[e] = new
                self._emit(
                    Transition(
                        "expert",
                        str(e),
                        self.LEVELS[level],
                        self.LEVELS[new],
                        self._clock(),
                        f"load {x:.0f} tokens",
                    )
                )

    def defers(self, qos: QoS, hist: Sequence[int]) -> bool:
        """Does an open breaker hold back a request of ``qos`` hitting ``hist``?"""
        if qos == QoS.REALTIME or not hist:
            return False
        need = 1 if qos == QoS.BACKGROUND else 2
        return any(n > 0 and self.levels[e] >= need for e, n in enumerate(hist))

    def hot(self) -> list[int]:
        return [e for e, lvl in enumerate(self.levels) if lvl > 0]


class GroupExpertBreaker:
    """Per engine group, on its measured expert load.

    ``pressure`` is the group's worst overload: the larger of its expert
    imbalance (busiest expert over the mean, any layer) over the allowed
    imbalance, and its busiest expert's tokens/s over that expert's capacity;
    1.0 is at the limit. Above 1.0 the breaker opens and defers background
    requests; above ``normal_factor`` it defers normal ones too. Realtime always
    runs. Once pressure falls below ``close_ratio`` it is half-open: normal runs
    again and background runs one request at a time; if pressure stays below 1.0
    for ``probe_s`` it closes, if it rises above 1.0 it opens again.
    """

    def __init__(
        self,
        key: str,
        *,
        normal_factor: float,
        close_ratio: float,
        probe_s: float,
        clock: Clock,
        emit: Emit,
    ) -> None:
        if normal_factor < 1 or not 0 < close_ratio <= 1 or probe_s <= 0:
            raise ValueError("bad group breaker thresholds")
        self.key = key
        self._normal_factor, self._close_ratio = normal_factor, close_ratio
        self._probe_s = probe_s
        self._clock, self._emit = clock, emit
        self.state = CLOSED
        self.pressure = 0.0
        self._half_open_at = 0.0

    def update(self, pressure: float) -> None:
        self.pressure = pressure
        state, now = self.state, self._clock()
        open_states = (OPEN, DEFER_NORMAL)
        normal_close = self._close_ratio * self._normal_factor
        if pressure > self._normal_factor:
            new = DEFER_NORMAL
        elif pressure > 1.0:
            keep = state == DEFER_NORMAL and pressure >= normal_close
            new = DEFER_NORMAL if keep else OPEN
        elif state in open_states and pressure < self._close_ratio:
            new = HALF_OPEN
            self._half_open_at = now
        elif state == DEFER_NORMAL and pressure < normal_close:
            new = OPEN
        elif state == HALF_OPEN and now - self._half_open_at >= self._probe_s:
            new = CLOSED
        else:
            new = state
        self._move(new, f"pressure {pressure:.2f}")

    def defers(self, qos: QoS, background_running: int) -> bool:
        """Does the breaker hold back a request of ``qos`` for this group now?"""
        if qos == QoS.REALTIME or self.state == CLOSED:
            return False
        if qos == QoS.NORMAL:
            return self.state == DEFER_NORMAL
        if self.state == HALF_OPEN:
            return background_running > 0  # one background probe at a time
        return True

    def _move(self, new: str, why: str) -> None:
        if new == self.state:
            return
        old, self.state = self.state, new
        self._emit(Transition("group", self.key, old, new, self._clock(), why))
