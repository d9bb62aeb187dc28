import pytest

from cluster.qos import QoS
from router.breakers import ExpertBreakers, ReplicaBreaker
from router.types import Transition
from tests.router.clock import Clock


def _replica(clock: Clock, log: list[Transition]) -> ReplicaBreaker:
    return ReplicaBreaker("r1", failures=3, open_s=5.0, clock=clock, emit=log.append)


def test_consecutive_failures_open_then_probe_closes() -> None:
    clock, log = Clock(), []
    b = _replica(clock, log)
    b.record(False)
    b.record(False)
    b.record(True)  # a success resets the count
    b.record(False)
    b.record(False)
    assert b.state == "closed" and b.allows()
    b.record(False)
    assert b.state == "open" and not b.allows()
    clock.advance(4.9)
    assert not b.allows()
    clock.advance(0.1)
    assert b.state == "half-open" and b.allows()
    assert b.on_dispatch() is True  # the one probe
    assert not b.allows()
    b.record(True)
    assert b.state == "closed" and b.allows() and b.on_dispatch() is False
    assert [(t.old, t.new) for t in log] == [
        ("closed", "open"),
        ("open", "half-open"),
        ("half-open", "closed"),
    ]
    assert log[0].detail == "3 consecutive failures" and log[0].at == 1000.0


def test_failed_probe_reopens_for_another_cool_down() -> None:
    clock, log = Clock(), []
    b = _replica(clock, log)
    for _ in range(3):
        b.record(False)
    clock.advance(5)
    b.on_dispatch()
    b.record(False)
    assert b.state == "open"
    clock.advance(4)
    assert b.state == "open"
    clock.advance(1)
    assert b.state == "half-open"


def test_abandoned_probe_allows_another() -> None:
    clock = Clock()
    b = _replica(clock, [])
    for _ in range(3):
        b.record(False)
    clock.advance(5)
    b.on_dispatch()
    assert not b.allows()
    b.abandon_probe()
    assert b.allows()


def test_bad_thresholds_rejected() -> None:
    with pytest.raises(ValueError):
        ReplicaBreaker("r", failures=0, open_s=1, clock=Clock(), emit=print)


def test_expert_levels_defer_background_then_normal_with_hysteresis() -> None:
    clock, log = Clock(), []
    eb = ExpertBreakers(
        3,
        capacity=100,
        normal_factor=1.5,
        close_ratio=0.8,
        clock=clock,
        emit=log.append,
    )
    hits_0 = (5, 0, 0)
    hits_1 = (0, 5, 0)
    eb.update([101, 0, 0])
    assert eb.levels == [1, 0, 0] and eb.hot() == [0]
    assert eb.defers(QoS.BACKGROUND, hits_0)
    assert not eb.defers(QoS.BACKGROUND, hits_1)  # a cool expert
    assert not eb.defers(QoS.NORMAL, hits_0)
    eb.update([151, 0, 0])
    assert eb.levels[0] == 2 and eb.defers(QoS.NORMAL, hits_0)
    assert not eb.defers(QoS.REALTIME, hits_0)  # realtime always runs
    eb.update([121, 0, 0])  # above 150 * 0.8: stays
    assert eb.levels[0] == 2
    eb.update([119, 0, 0])
    assert eb.levels[0] == 1
    eb.update([81, 0, 0])  # above 100 * 0.8: stays
    assert eb.levels[0] == 1
    eb.update([10, 0, 0])
    assert eb.levels[0] == 0
    assert [(t.key, t.old, t.new) for t in log] == [
        ("0", "closed", "defer-background"),
        ("0", "defer-background", "defer-normal"),
        ("0", "defer-normal", "defer-background"),
        ("0", "defer-background", "closed"),
    ]
    eb.update([500, 0, 0])  # jumps two levels in one transition
    assert log[-1].old == "closed" and log[-1].new == "defer-normal"
