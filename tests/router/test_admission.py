import pytest

from cluster.qos import QoS
from router.admission import ClassQueues, RateMeter, Waiting
from router.types import Ticket

W = {QoS.REALTIME: 4.0, QoS.NORMAL: 2.0, QoS.BACKGROUND: 1.0}
L = {QoS.REALTIME: 100, QoS.NORMAL: 100, QoS.BACKGROUND: 2}


def _w(qos: QoS, n: int) -> Waiting:
    return Waiting(Ticket(f"{qos.name}-{n}", qos, 10, 10), 0.0, None)


def _serve(q: ClassQueues, n: int) -> list[QoS]:
    order = []
    for _ in range(n):
        qos = q.classes_in_order()[0]
        q.take(next(q.waiting(qos)))
        order.append(qos)
    return order


def test_weighted_fair_order_never_starves_background() -> None:
    q = ClassQueues(W, {c: 100 for c in QoS})
    for i in range(20):
        for c in QoS:
            q.push(_w(c, i))
    got = _serve(q, 14)
    # stride 1/4, 1/2, 1: per 7 dispatches 4 realtime, 2 normal, 1 background
    assert got.count(QoS.REALTIME) == 8
    assert got.count(QoS.NORMAL) == 4
    assert got.count(QoS.BACKGROUND) == 2
    assert got[:3] == [QoS.REALTIME, QoS.NORMAL, QoS.BACKGROUND]  # ties: urgent first


def test_idle_class_rejoins_without_credit() -> None:
    q = ClassQueues(W, {c: 100 for c in QoS})
    for i in range(10):
        q.push(_w(QoS.BACKGROUND, i))
    _serve(q, 10)  # background alone: its pass is now 10
    for i in range(10):
        q.push(_w(QoS.REALTIME, i))
        q.push(_w(QoS.BACKGROUND, 100 + i))
    # realtime rejoins at background's last pass (9), not at 0: 4 realtime at
    # passes 9..9.75, a tie at 10 goes to realtime, then background's turn.
    assert _serve(q, 6) == [QoS.REALTIME] * 5 + [QoS.BACKGROUND]


def test_limits_and_fifo_within_class() -> None:
    q = ClassQueues(W, L)
    a, b = _w(QoS.BACKGROUND, 1), _w(QoS.BACKGROUND, 2)
    q.push(a)
    q.push(b)
    assert q.full(QoS.BACKGROUND) and not q.full(QoS.NORMAL)
    assert list(q.waiting(QoS.BACKGROUND)) == [a, b]
    q.drop(a)
    assert list(q.waiting(QoS.BACKGROUND)) == [b] and len(q) == 1


def test_ahead_of_new_follows_the_shares() -> None:
    q = ClassQueues(W, {c: 100 for c in QoS})
    for i in range(10):
        q.push(_w(QoS.BACKGROUND, i))
        q.push(_w(QoS.NORMAL, i))
    # a new realtime request: 0 realtime ahead, normal gets 1*2/4, background 1*1/4
    assert q.ahead_of_new(QoS.REALTIME) == pytest.approx(0.75)
    # a new background one waits for its 10 peers and 11*4 realtime shares (0
    # queued) and min(10, 22) normal
    assert q.ahead_of_new(QoS.BACKGROUND) == pytest.approx(20)


def test_rate_meter_window() -> None:
    m = RateMeter(window_s=10, min_events=4)
    for t in (0, 1, 2):
        m.add(t)
    assert m.rate(2) is None
    m.add(3)
    assert m.rate(3) == pytest.approx(1.0)
    assert m.rate(12.5) is None  # old events left the window


def test_bad_weights_rejected() -> None:
    with pytest.raises(ValueError):
        ClassQueues({**W, QoS.BACKGROUND: 0}, L)
