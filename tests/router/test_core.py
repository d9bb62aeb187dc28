from typing import Any

import pytest

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.admission import Waiting
from router.core import RouterCore
from router.settings import CoreSettings
from router.types import (
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    RequestProgress,
    RouteDecision,
    Shed,
    Ticket,
)
from tests.router.clock import Clock
from tests.router.support import submit

RT, NORMAL, BG = QoS.REALTIME, QoS.NORMAL, QoS.BACKGROUND


def _core(clock: Clock, **kw: Any) -> RouterCore:
    defaults: dict[str, Any] = {
        "max_running_per_replica": 2,
        "realtime_reserved_slots": 1,
        "max_queued": {"realtime": 10, "normal": 10, "background": 3},
    }
    cfg = RouterConfig.model_validate({**defaults, **kw})
    core = RouterCore(CoreSettings.of(cfg), num_experts=4, clock=clock)
    for r in ("a", "b"):
        core.report(ReplicaReport(ReplicaId(r)))
    return core


def _t(rid: str, qos: QoS = NORMAL, **kw: Any) -> Ticket:
    return Ticket(rid, qos, kw.pop("prompt", 10), kw.pop("max_tokens", 10), **kw)


def _ok(core: RouterCore, rid: str, replica: str = "", ttft: float = 0.01) -> None:
    core.release(
        Release(rid, Outcome.OK, ReplicaId(replica) if replica else None, ttft)
    )


def test_dispatches_least_loaded_until_slots_are_full_then_queues() -> None:
    core = _core(Clock())
    d1 = submit(core, _t("1", prompt=100))
    d2 = submit(core, _t("2"))
    assert isinstance(d1, RouteDecision) and isinstance(d2, RouteDecision)
    assert (d1.replica_id, d2.replica_id) == ("a", "b")
    assert submit(core, _t("3")).replica_id == "b"  # type: ignore[union-attr]
    assert submit(core, _t("4")).replica_id == "a"  # type: ignore[union-attr]
    w = submit(core, _t("5"))  # 2 running on each: full
    assert isinstance(w, Waiting)
    assert core.snapshot().queued["normal"] == 1
    # realtime uses the reserved slot instead of waiting
    rt = submit(core, _t("r", RT))
    assert isinstance(rt, RouteDecision) and rt.replica_id == "b"
    _ok(core, "2")
    assert core.pump() == []  # b runs 3 with realtime's reserved slot: still full
    _ok(core, "1")
    [(waiting, decision)] = core.pump()
    assert waiting is w and decision.replica_id == "a" and decision.queued_s == 0


def test_freed_slots_go_in_weighted_fair_order() -> None:
    clock = Clock()
    core = _core(
        clock,
        class_weights={"realtime": 2, "normal": 1, "background": 1},
        realtime_reserved_slots=0,
    )
    for i in range(4):
        submit(core, _t(f"fill{i}"))
    waiting = [submit(core, _t(f"bg{i}", BG)) for i in range(3)]
    waiting += [submit(core, _t(f"rt{i}", RT)) for i in range(3)]
    assert all(isinstance(w, Waiting) for w in waiting)
    order = []
    for i in range(4):
        _ok(core, f"fill{i}")
        order += [w.ticket.request_id for w, _ in core.pump()]
    assert order == ["rt0", "bg0", "rt1", "rt2"]


def test_impossible_deadline_is_shed_at_once() -> None:
    core = _core(Clock(), default_ttft_ms=50)
    with pytest.raises(Shed) as e:
        submit(core, _t("1", RT, deadline_s=0.001))
    assert e.value.reason == "deadline" and e.value.retry_after_s == 1.0
    assert "shorter than the expected time to first token (50 ms)" in str(e.value)
    assert core.snapshot().shed == {"realtime/deadline": 1}


def test_full_class_queue_sheds_with_retry_hint() -> None:
    core = _core(Clock(), realtime_reserved_slots=0)
    for i in range(4):
        submit(core, _t(f"fill{i}"))
    for i in range(3):
        submit(core, _t(f"bg{i}", BG))
    with pytest.raises(Shed, match="background queue is full") as e:
        submit(core, _t("bg3", BG))
    assert e.value.reason == "queue-full"
    assert isinstance(
        submit(core, _t("n", NORMAL)), Waiting
    )  # other classes still queue


def test_deadline_shed_from_measured_dispatch_rate() -> None:
    clock = Clock()
    core = _core(
        clock,
        realtime_reserved_slots=0,
        max_queued={"realtime": 50, "normal": 50, "background": 50},
    )
    for i in range(4):
        submit(core, _t(f"fill{i}"))
    for i in range(4):  # 4 slots freed in 2 s: 2 per second
        clock.advance(0.5)
        _ok(core, f"fill{i}", ttft=0.02)
        submit(core, _t(f"again{i}"))
        core.pump()
    for i in range(6):
        submit(core, _t(f"q{i}"))
    # 6 dispatches ahead of a new normal request at 2/s: 3 s, plus 20 ms TTFT
    assert core.expected_wait(NORMAL) == pytest.approx(3.0)
    assert isinstance(submit(core, _t("ok", deadline_s=3.1)), Waiting)
    with pytest.raises(Shed, match="expected wait 3500 ms") as e:
        submit(core, _t("late", deadline_s=3.5))
    assert e.value.retry_after_s == pytest.approx(3.5)


def test_tick_sheds_requests_whose_deadline_passed_in_queue() -> None:
    clock = Clock()
    core = _core(clock, realtime_reserved_slots=0, max_wait_s=30)
    for i in range(4):
        submit(core, _t(f"fill{i}"))
    w = submit(core, _t("d", deadline_s=1.0))
    forever = submit(core, _t("f"))
    clock.advance(0.96)  # 0.96 + 50 ms TTFT estimate > 1.0
    [(shed_w, shed)] = core.tick()
    assert shed_w is w and shed.reason == "deadline"
    clock.advance(30)
    [(shed_w, shed)] = core.tick()
    assert shed_w is forever and shed.reason == "queue-timeout"


def test_failing_replica_is_opened_and_probed() -> None:
    clock = Clock()
    core = _core(clock, breaker_failures=2, breaker_open_s=5, max_running_per_replica=8)
    for i in range(2):
        d = submit(core, _t(f"x{i}", prompt=1000))  # heavy: keeps choosing "b" next
        core.release(Release(f"x{i}", Outcome.FAILED, ReplicaId("a")))
    assert core.snapshot().replicas["a"].breaker == "open"
    picks = set()
    for i in range(3):
        d = submit(core, _t(f"y{i}"))
        assert isinstance(d, RouteDecision)
        picks.add(d.replica_id)
    assert picks == {"b"}
    clock.advance(5)
    probe = submit(core, _t("p", RT))
    assert isinstance(probe, RouteDecision)
    assert (probe.replica_id, probe.reason) == ("a", "half-open-probe")
    _ok(core, "p", "a")
    assert core.snapshot().replicas["a"].breaker == "closed"
    kinds = [(t.key, t.new) for t in core.transitions]
    assert kinds == [("a", "open"), ("a", "half-open"), ("a", "closed")]


def test_cancelled_requests_do_not_count_against_the_replica() -> None:
    core = _core(Clock(), breaker_failures=1)
    submit(core, _t("x"))
    core.release(Release("x", Outcome.CANCELLED, ReplicaId("a")))
    assert core.snapshot().replicas["a"].breaker == "closed"


def test_restarted_router_rebuilds_leases_from_reports() -> None:
    clock = Clock()
    core = _core(clock)
    busy = tuple(
        RequestProgress(f"s{i}", 10, 3, 10) for i in range(2)
    )  # streams running on a when the router restarted
    core.report(ReplicaReport(ReplicaId("a"), busy, tokens_per_s=50))
    snap = core.snapshot().replicas["a"]
    assert snap.running == 2 and snap.load_tokens == 14
    assert submit(core, _t("new")).replica_id == "b"  # type: ignore[union-attr]
    _ok(core, "s0")  # a stream finished: released...
    core.report(ReplicaReport(ReplicaId("a"), busy))  # ...and a stale report lists it
    assert core.snapshot().replicas["a"].running == 1
    core.report(ReplicaReport(ReplicaId("a"), ()))
    assert core.snapshot().replicas["a"].running == 0


def test_a_release_is_remembered_for_ten_seconds_after_the_last_one() -> None:
    """A report listing a request released in the last 10 s was on its way:
    it makes no lease. Ticks forget older releases, each from its last."""
    clock = Clock()
    core = _core(clock, replica_stale_s=60)

    def listing(*ids: str) -> ReplicaReport:
        return ReplicaReport(
            ReplicaId("a"), tuple(RequestProgress(i, 10, 3, 10) for i in ids)
        )

    _ok(core, "old")
    clock.advance(4)
    _ok(core, "new")
    clock.advance(4)
    _ok(core, "old")  # released again (a retried release): remembered from now
    clock.advance(7)  # "new" was released 11 s ago, "old" 7 s ago
    core.tick()
    core.report(listing("old", "new"))
    assert core.snapshot().replicas["a"].running == 1  # "new" only
    clock.advance(4)
    core.tick()
    core.report(listing("old", "new"))
    assert core.snapshot().replicas["a"].running == 2


def test_dispatched_lease_survives_reports_until_grace() -> None:
    clock = Clock()
    core = _core(clock)
    submit(core, _t("x"))  # to a
    core.report(ReplicaReport(ReplicaId("a")))  # too early to be listed
    assert core.snapshot().replicas["a"].running == 1
    clock.advance(3.1)
    core.report(ReplicaReport(ReplicaId("a")))
    assert core.snapshot().replicas["a"].running == 0


def test_silent_replica_is_dropped() -> None:
    clock = Clock()
    core = _core(clock, replica_stale_s=5)
    clock.advance(4)
    core.report(ReplicaReport(ReplicaId("b")))
    clock.advance(2)
    core.tick()
    assert list(core.snapshot().replicas) == ["b"]
    assert core.transitions[-1].new == "gone"


def test_expert_breaker_defers_background_not_realtime() -> None:
    core = _core(
        Clock(),
        expert_capacity_tokens=10,
        expert_normal_factor=2,
        max_running_per_replica=8,
    )
    hot = (8, 0, 0, 0)
    assert isinstance(submit(core, _t("1", NORMAL, expert_hist=hot)), RouteDecision)
    assert isinstance(submit(core, _t("2", NORMAL, expert_hist=hot)), RouteDecision)
    assert core.snapshot().hot_experts == (0,)  # 16 > 10
    bg = submit(core, _t("bg", BG, expert_hist=hot))
    assert isinstance(bg, Waiting)  # deferred
    cool = submit(core, _t("bg-cool", BG, expert_hist=(0, 4, 0, 0)))
    assert isinstance(cool, RouteDecision)  # other experts are fine
    assert isinstance(submit(core, _t("n", NORMAL, expert_hist=hot)), RouteDecision)
    # 24 > 20: normal now deferred too, realtime still runs
    assert isinstance(submit(core, _t("n2", NORMAL, expert_hist=hot)), Waiting)
    assert isinstance(submit(core, _t("r", RT, expert_hist=hot)), RouteDecision)
    for rid in ("1", "2", "n", "r"):
        _ok(core, rid)
    core.tick()
    assert core.snapshot().hot_experts == ()
    released = {w.ticket.request_id for w, _ in core.pump()}
    assert released == {"bg", "n2"}


def test_served_ttft_per_class_counts_the_queue_wait() -> None:
    clock = Clock()
    core = _core(clock, realtime_reserved_slots=0)
    for i in range(4):
        submit(core, _t(f"fill{i}"))
    assert isinstance(submit(core, _t("rt", RT)), Waiting)
    clock.advance(0.5)
    _ok(core, "fill0")
    [(w, _)] = core.pump()
    assert w.ticket.request_id == "rt"
    _ok(core, "rt", ttft=0.1)  # dispatch to first token
    served = core.snapshot().ttft_ms["realtime"]
    assert served is not None and served.n == 1
    assert (served.p50, served.p99) == pytest.approx((600.0, 600.0))
    assert core.snapshot().ttft_ms["background"] is None


def test_the_snapshot_counts_decisions_and_the_prefix_hit_rate() -> None:
    from kvstore.block_hash import block_hashes
    from router.types import KVEvent

    core = _core(Clock(), policy="prefix")
    hashes = block_hashes(list(range(64)), 16)  # 4 blocks
    core.report(
        ReplicaReport(ReplicaId("b"), kv_events=(KVEvent("stored", hashes[:3]),))
    )
    assert core.snapshot().prefix_hit_rate is None  # nothing placed yet
    d = submit(core, _t("1", block_hashes=hashes))
    assert isinstance(d, RouteDecision) and (d.replica_id, d.cached_blocks) == ("b", 3)
    submit(core, _t("2", block_hashes=block_hashes(list(range(100, 132)), 16)))
    snap = core.snapshot()
    assert snap.routed == {"prefix": 1, "least-loaded": 1}
    assert snap.prefix_hit_rate == 3 / 6


def test_a_submit_returns_every_waiting_request_it_dispatched() -> None:
    """Others a submit dispatches come with its own outcome, also those placed
    after it (they were once dropped: placed in the core, never told)."""
    core = _core(Clock())
    for i in range(4):
        submit(core, _t(str(i)))  # 2 running on each replica: full
    queued = submit(core, _t("q"))
    assert isinstance(queued, Waiting)
    _ok(core, "0")  # two slots free; nothing pumped yet
    _ok(core, "3")
    s = core.submit(_t("r", RT))  # realtime goes first, then the queued one
    assert isinstance(s.outcome, RouteDecision)
    assert [w.ticket.request_id for w, _ in s.dispatched] == ["q"]
    assert core.snapshot().queued["normal"] == 0
    refused = core.submit(_t("late", BG, deadline_s=1e-4))
    assert isinstance(refused.outcome, Shed) and refused.dispatched == ()


def test_a_replica_serve_stops_drains_its_leases_and_takes_no_new_work() -> None:
    clock = Clock()
    core = _core(clock)
    first = submit(core, _t("1"))
    assert isinstance(first, RouteDecision) and first.replica_id == "a"
    core.serving_changed(added=[], removed=[ReplicaId("a")])
    # Its report is answered "draining"; the lease it holds stays until released.
    assert core.report(ReplicaReport(ReplicaId("a"))) is True
    assert core.report(ReplicaReport(ReplicaId("b"))) is False
    assert core.snapshot().replicas["a"].draining
    assert core.replicas[ReplicaId("a")].running == 1
    # New work, realtime included, goes to the other replica only (2 slots,
    # and realtime's reserved one) ...
    for i, qos in enumerate((NORMAL, NORMAL, RT)):
        d = submit(core, _t(f"n{i}", qos))
        assert isinstance(d, RouteDecision) and d.replica_id == "b", i
    # ... or waits, though "a" has a free slot.
    assert isinstance(submit(core, _t("w")), Waiting)
    # A stream handed off while draining does not count against the replica.
    core.release(Release("1", Outcome.HANDED_OFF, ReplicaId("a")))
    assert core.replicas[ReplicaId("a")].breaker.state == "closed"
    assert core.replicas[ReplicaId("a")].running == 0


def test_a_draining_replica_that_serve_keeps_serves_again() -> None:
    core = _core(Clock())
    core.serving_changed(added=[], removed=[ReplicaId("a"), ReplicaId("b")])
    assert isinstance(submit(core, _t("1")), Waiting)  # nothing serves
    core.serving_changed(added=[ReplicaId("b")], removed=[])
    assert core.report(ReplicaReport(ReplicaId("b"))) is False
    d = core.pump()
    assert [(w.ticket.request_id, r.replica_id) for w, r in d] == [("1", "b")]


def test_a_replica_retired_before_its_first_report_drains_from_the_start() -> None:
    clock = Clock()
    core = _core(clock)
    core.serving_changed(added=[], removed=[ReplicaId("c")])
    assert core.report(ReplicaReport(ReplicaId("c"))) is True
    # Forgotten once it has gone quiet for long.
    clock.advance(core.config.replica_stale_s + 1)
    core.report(ReplicaReport(ReplicaId("a")))
    core.tick()
    assert ReplicaId("c") not in core.replicas
    clock.advance(601)
    core.tick()
    assert core.retired == {}


def test_a_starting_replica_is_known_but_gets_work_only_once_ready() -> None:
    """A replica reports while it warms up, before Serve's handles can reach it:
    the router counts it, but places nothing there until it says it is ready."""
    core = _core(Clock())
    core.report(ReplicaReport(ReplicaId("c"), ready=False))
    assert core.snapshot().replicas["c"].starting
    assert core.load_signals().serving == 2
    # Least-loaded would pick the idle "c" first; it waits for "c" instead.
    placed = [submit(core, _t(f"s{i}")) for i in range(4)]
    assert {d.replica_id for d in placed if isinstance(d, RouteDecision)} == {"a", "b"}
    assert isinstance(submit(core, _t("w")), Waiting)
    core.report(ReplicaReport(ReplicaId("c")))
    assert not core.snapshot().replicas["c"].starting
    [(w, d)] = core.pump()
    assert w.ticket.request_id == "w" and d.replica_id == "c"
    assert core.load_signals().serving == 3


def test_a_resumed_request_avoids_the_replica_it_failed_on_while_another_has_room() -> (
    None
):
    core = _core(Clock())
    d = submit(core, _t("r1", resumed=True, avoid="a"))  # both idle: "a" first
    assert isinstance(d, RouteDecision) and d.replica_id == "b"
    d = submit(core, _t("r2", resumed=True, avoid="a"))
    assert isinstance(d, RouteDecision) and d.replica_id == "b"  # now full
    d = submit(core, _t("r3", resumed=True, avoid="a"))
    assert isinstance(d, RouteDecision) and d.replica_id == "a"  # the only room


def test_a_replicas_load_follows_its_leases_as_they_come_progress_and_go() -> None:
    """The load every placement reads is kept as leases change, and always
    equals what the leases still have to compute."""
    clock = Clock()
    core = _core(clock)
    a = ReplicaId("a")

    def load() -> tuple[int, int]:
        r = core.replicas[a]
        return r.load_tokens, sum(x.remaining_tokens for x in r.leases.values())

    core.report(ReplicaReport(a, (RequestProgress("s0", 10, 0, 10),)))
    assert load() == (20, 20)  # prompt and decode budget
    core.report(ReplicaReport(a, (RequestProgress("s0", 10, 4, 10),)))
    assert load() == (6, 6)  # prefilled, 6 to decode
    decision = submit(core, _t("x", prompt=30, max_tokens=5))
    assert isinstance(decision, RouteDecision) and decision.replica_id == "b"
    decision = submit(core, _t("z", prompt=7, max_tokens=5))
    assert isinstance(decision, RouteDecision) and decision.replica_id == "a"
    assert load() == (18, 18)
    core.report(ReplicaReport(a, (RequestProgress("s0", 10, 12, 10),)))
    assert load() == (12, 12)  # past its budget: nothing left, not negative
    _ok(core, "z")
    core.report(ReplicaReport(a, ()))
    assert load() == (0, 0)
