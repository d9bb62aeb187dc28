"""EP groups in the router: a group serves only whole, and its expert breaker
defers background, then normal, on measured expert load; realtime always runs."""

from typing import Any

import pytest

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.admission import Waiting
from router.breakers import GroupExpertBreaker
from router.core import RouterCore, expert_pressure
from router.settings import CoreSettings
from router.types import (
    ExpertLoad,
    Outcome,
    Release,
    ReplicaId,
    ReplicaReport,
    RouteDecision,
    Ticket,
    Transition,
)
from tests.router.clock import Clock
from tests.router.support import submit

RT, NORMAL, BG = QoS.REALTIME, QoS.NORMAL, QoS.BACKGROUND
EVEN = ((10, 10, 10, 10), (10, 10, 10, 10))  # 2 layers x 4 experts
HOT = ((70, 10, 0, 0), (40, 40, 0, 0))  # layer 1: 70 / mean 20 = 3.5


def _load(counts: tuple[tuple[int, ...], ...], window_s: float = 10) -> ExpertLoad:
    return ExpertLoad((1, 2), counts, window_s)


def _report(
    rid: str, load: ExpertLoad | None = None, group: str = "g", size: int = 2
) -> ReplicaReport:
    rank = int(rid[-1]) if rid[-1].isdigit() else 0
    return ReplicaReport(
        ReplicaId(rid), expert_load=load, group=group, rank=rank, group_size=size
    )


def _core(clock: Clock, **kw: Any) -> RouterCore:
    cfg = RouterConfig.model_validate(
        {"max_running_per_replica": 4, "realtime_reserved_slots": 1, **kw}
    )
    return RouterCore(CoreSettings.of(cfg), num_experts=4, clock=clock)


def test_expert_load_merges_ranks_and_measures_imbalance() -> None:
    a = ExpertLoad((1, 2), ((4, 0, 0, 0), (1, 1, 1, 1)), 5.0)
    b = ExpertLoad((1, 2), ((0, 0, 0, 4), (1, 1, 1, 1)), 10.0)
    merged = ExpertLoad.merge([a, b])
    assert merged == ExpertLoad((1, 2), ((4, 0, 0, 4), (2, 2, 2, 2)), 10.0)
    assert merged.per_expert() == [6, 2, 2, 6]
    assert merged.imbalance() == {1: 2.0, 2: 1.0}
    assert merged.imbalance(min_tokens=9) == {}  # too few tokens to judge
    assert merged.hottest_rate() == 0.4
    assert ExpertLoad.merge([]) is None


def test_pressure_is_the_worse_of_imbalance_and_expert_rate() -> None:
    cfg = RouterConfig(expert_max_imbalance=2.0, expert_min_window_tokens=10)
    assert expert_pressure(_load(EVEN), cfg) == 0.5
    assert expert_pressure(_load(HOT), cfg) == 1.75
    assert expert_pressure(None, cfg) == 0.0
    rate = RouterConfig(expert_max_tokens_per_s=3.5)
    assert expert_pressure(_load(HOT), rate) == 2.0  # 70 tokens / 10 s / 3.5


def test_a_group_takes_work_only_while_every_rank_reports() -> None:
    clock = Clock()
    core = _core(clock, replica_stale_s=2)
    core.report(_report("r0"))
    # One rank of two: the group is not whole yet.
    assert isinstance(submit(core, Ticket("1", NORMAL, 8, 8)), Waiting)
    core.report(_report("r1"))
    core.pump()
    assert core.snapshot().groups["g"].serving
    # Both ranks take work: the group is one replica with two entry ranks.
    placed = {
        submit(core, Ticket(str(i), NORMAL, 8, 8)).replica_id for i in range(2, 5)
    }  # type: ignore[union-attr]
    assert placed == {"r0", "r1"}
    # Rank 1 dies (no more reports): the group stops taking work, rank 0 too.
    clock.advance(1.5)
    core.report(_report("r0"))
    clock.advance(1.0)
    core.tick()
    assert "r1" not in core.replicas
    assert isinstance(submit(core, Ticket("x", RT, 8, 8)), Waiting)
    assert not core.snapshot().groups["g"].serving


def test_a_failing_rank_stops_its_whole_group() -> None:
    core = _core(Clock(), breaker_failures=1)
    for rid in ("r0", "r1"):
        core.report(_report(rid))
    core.report(ReplicaReport(ReplicaId("solo")))
    d = submit(core, Ticket("1", NORMAL, 8, 8))
    assert isinstance(d, RouteDecision)
    core.release(Release("1", Outcome.FAILED, ReplicaId("r1")))
    for i in range(4):
        d = submit(core, Ticket(f"n{i}", NORMAL, 8, 8))
        assert isinstance(d, RouteDecision) and d.replica_id == "solo"


def test_breaker_defers_background_then_normal_realtime_runs() -> None:
    clock = Clock()
    core = _core(
        clock,
        expert_max_imbalance=2.0,
        expert_normal_factor=1.5,
        expert_close_ratio=0.8,
        expert_probe_s=5,
        expert_min_window_tokens=10,
    )
    core.report(_report("r0", _load(EVEN)))
    core.report(_report("r1", _load(EVEN)))
    assert core.group_breakers["g"].state == "closed"
    # Rank 0's tokens pile onto expert 0 of layer 1: with rank 1's, 200 against a
    # mean of 65, imbalance 3.08, pressure 1.54 > 1.5.
    core.report(_report("r0", _load(((190, 10, 10, 10), (10, 10, 10, 10)))))
    assert core.group_breakers["g"].state == "open-normal"
    assert isinstance(submit(core, Ticket("bg", BG, 8, 8)), Waiting)
    assert isinstance(submit(core, Ticket("n", NORMAL, 8, 8)), Waiting)
    assert isinstance(submit(core, Ticket("rt", RT, 8, 8)), RouteDecision)
    # Cooling to 1.1 (between 1.0 and 0.8 x 1.5): normal runs, background waits.
    core.report(_report("r0", _load(((63, 10, 10, 10), (10, 10, 10, 10)))))
    assert core.group_breakers["g"].state == "open"
    assert [d.replica_id for _, d in core.pump()]  # the queued normal request
    assert core.queues.depth(NORMAL) == 0 and core.queues.depth(BG) == 1
    # Cool (below 0.8): half-open lets one background request through at a time.
    core.report(_report("r0", _load(EVEN)))
    assert core.group_breakers["g"].state == "half-open"
    assert len(core.pump()) == 1
    assert isinstance(submit(core, Ticket("bg2", BG, 8, 8)), Waiting)
    # Still cool after probe_s: closed, background flows again.
    clock.advance(5)
    core.tick()
    assert core.group_breakers["g"].state == "closed"
    assert len(core.pump()) == 1
    kinds = [(t.kind, t.old, t.new) for t in core.transitions if t.kind == "group"]
    assert kinds == [
        ("group", "closed", "open-normal"),
        ("group", "open-normal", "open"),
        ("group", "open", "half-open"),
        ("group", "half-open", "closed"),
    ]


def test_half_open_reopens_when_load_rises_again() -> None:
    clock = Clock()
    seen: list[Transition] = []
    b = GroupExpertBreaker(
        "g",
        normal_factor=1.5,
        close_ratio=0.8,
        probe_s=5,
        clock=clock,
        emit=seen.append,
    )
    b.update(1.2)
    b.update(0.9)  # hysteresis: not cool enough to half-open
    assert b.state == "open" and b.defers(BG, 0) and not b.defers(NORMAL, 0)
    b.update(0.5)
    assert b.state == "half-open"
    assert not b.defers(BG, 0) and b.defers(BG, 1) and not b.defers(RT, 5)
    clock.advance(2)
    b.update(1.3)
    assert b.state == "open"
    assert [t.new for t in seen] == ["open", "half-open", "open"]
    with pytest.raises(ValueError):
        GroupExpertBreaker(
            "g", normal_factor=0.5, close_ratio=0.8, probe_s=1, clock=clock, emit=print
        )


def test_no_group_breaker_without_a_threshold() -> None:
    core = _core(Clock())
    core.report(_report("r0", _load(HOT)))
    assert core.group_breakers == {}
