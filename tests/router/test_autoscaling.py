"""The QoS-aware autoscaling policy: pure decisions on a given clock, the
router's signals that feed them, and the Ray Serve entry point."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.qos import QoS
from router.autoscaling import (
    Decision,
    LoadSignals,
    ScalePolicy,
    ServePolicy,
    decide,
)
from tests.router.clock import Clock
from tests.router.support import submit
from tests.router.test_core import _core, _t

P = ScalePolicy(
    min_replicas=1,
    max_replicas=4,
    slo_ttft_s=(0.5, 2.0),
    background_max_age_s=30,
    target_utilization=0.8,
    downscale_utilization=0.4,
    upscale_delay_s=2,
    downscale_delay_s=10,
)
IDLE = LoadSignals(
    queued=(0, 0, 0),
    oldest_wait_s=(0.0, 0.0, 0.0),
    ttft_estimate_s=0.05,
    running=(0, 0, 0),
    slots=6,
    serving=1,
    shed=(0, 0, 0),
)


def run(
    signals: list[tuple[float, LoadSignals]], current: int, p: ScalePolicy = P
) -> list[Decision]:
    """Decisions at each (time, signals), the count following them."""
    out: list[Decision] = []
    previous = None
    for now, s in signals:
        d = decide(s, current, previous, now, p)
        out.append(d)
        previous, current = d, d.replicas
    return out


def test_a_realtime_request_about_to_miss_its_slo_scales_up_after_the_delay() -> None:
    late = replace(IDLE, queued=(2, 0, 0), oldest_wait_s=(0.5, 0, 0), running=(0, 6, 0))
    ds = run([(0, late), (1, late), (2, late), (3, late)], current=1)
    assert [d.replicas for d in ds] == [1, 1, 2, 2]
    assert ds[0].reason == "wait:realtime_slo" and ds[2].reason == "realtime_slo"


def test_pressure_that_goes_away_before_the_delay_does_not_scale() -> None:
    late = replace(IDLE, queued=(0, 3, 0), oldest_wait_s=(0, 2.5, 0), running=(0, 6, 0))
    calm = replace(IDLE, running=(0, 3, 0))
    ds = run([(0, late), (1.5, calm), (2.5, late), (4.0, late)], current=1)
    assert [d.replicas for d in ds] == [1, 1, 1, 1]  # the delay started again
    assert run([(0, late), (1.5, calm), (2.5, late), (4.5, late)], 1)[-1].replicas == 2


def test_a_deep_queue_asks_for_enough_replicas_at_once() -> None:
    # 6 running and 18 waiting normal requests, 6 slots a replica at 80%: 5,
    # bounded by max_replicas.
    flood = replace(IDLE, queued=(0, 18, 0), oldest_wait_s=(0, 3, 0), running=(0, 6, 0))
    assert run([(0, flood), (2, flood)], current=1)[-1].replicas == 4


def test_busy_slots_scale_up_before_anything_waits() -> None:
    busy = replace(IDLE, running=(0, 11, 0), slots=12, serving=2)
    ds = run([(0, busy), (2, busy)], current=2)
    assert ds[-1] == Decision(3, "utilization")


def test_background_scales_up_only_once_its_backlog_is_old() -> None:
    young = replace(
        IDLE, queued=(0, 0, 50), oldest_wait_s=(0, 0, 20), running=(0, 0, 6)
    )
    old = replace(young, oldest_wait_s=(0, 0, 31))
    assert run([(0, young), (5, young)], current=1)[-1].replicas == 1
    ds = run([(0, old), (2, old)], current=1)
    assert ds[-1] == Decision(2, "background_age")


def test_scale_down_waits_for_an_idle_stretch_and_steps_one_at_a_time() -> None:
    quiet = replace(IDLE, running=(0, 2, 0), slots=18, serving=3)
    ds = run([(t, quiet) for t in (0, 5, 10, 15, 20, 25)], current=3)
    assert [d.replicas for d in ds] == [3, 3, 2, 2, 2, 1]
    assert ds[2].reason == "idle" and ds[-1].reason == "idle"
    # Never below min_replicas.
    assert run([(0, quiet), (20, quiet)], current=1)[-1].replicas == 1


def test_hysteresis_no_scale_down_while_one_fewer_would_be_busy() -> None:
    # 3 running on 2 replicas: one would hold 3 of 6 slots, over 40%.
    mid = replace(IDLE, running=(0, 3, 0), slots=12, serving=2)
    assert run([(0, mid), (30, mid)], current=2)[-1] == Decision(2, "hold")
    # Nor while anything but young background waits.
    waiting = replace(IDLE, queued=(1, 0, 0), slots=12, serving=2)
    assert run([(0, waiting), (30, waiting)], current=2)[-1].replicas == 2


def test_ep_groups_scale_in_whole_groups() -> None:
    p = replace(P, min_replicas=2, max_replicas=8, unit=2)
    late = replace(
        IDLE, queued=(1, 0, 0), oldest_wait_s=(1, 0, 0), running=(0, 6, 0), serving=2
    )
    assert run([(0, late), (2, late)], current=2, p=p)[-1].replicas == 4
    quiet = replace(IDLE, running=(0, 0, 0), slots=24, serving=4)
    assert run([(0, quiet), (10, quiet)], current=4, p=p)[-1].replicas == 2
    with pytest.raises(ValueError, match="whole EP groups"):
        ScalePolicy(min_replicas=2, max_replicas=5, unit=2)


def test_realtime_or_normal_sheds_scale_up_background_ones_do_not() -> None:
    calm = replace(IDLE, running=(0, 2, 0), shed=(0, 3, 9))
    # The first view sets the count; more background sheds are not pressure.
    more_bg = replace(calm, shed=(0, 3, 20))
    assert [d.replicas for d in run([(0, calm), (5, more_bg)], current=1)] == [1, 1]
    shed = replace(calm, shed=(2, 3, 9))
    ds = run([(0, calm), (1, shed), (2, shed), (3, shed)], current=1)
    assert [d.reason for d in ds][1:] == ["wait:shed", "wait:shed", "shed"]
    assert ds[-1].replicas == 2


def test_no_signals_holds() -> None:
    assert decide(None, 3, None, 0.0, P) == Decision(3, "no_signals")


def test_signals_survive_serves_metrics_round_trip() -> None:
    s = replace(IDLE, queued=(1, 2, 3), oldest_wait_s=(0.5, 1.5, 9.0), shed=(4, 0, 1))
    metrics = s.as_metrics()
    assert metrics["queued_realtime"] == 1 and metrics["oldest_wait_s_background"] == 9
    assert LoadSignals.from_metrics(metrics) == s
    del metrics["slots"]
    assert LoadSignals.from_metrics(metrics) is None


def test_the_router_core_reports_waits_per_class() -> None:
    clock = Clock()
    core = _core(clock)  # 2 replicas x 2 slots
    for i in range(4):
        submit(core, _t(f"n{i}"))
    submit(core, _t("w1"))
    clock.advance(0.7)
    submit(core, _t("w2", QoS.BACKGROUND))
    clock.advance(0.3)
    s = core.load_signals()
    assert s.queued == (0, 1, 1) and s.running == (0, 4, 0)
    assert s.oldest_wait_s == pytest.approx((0.0, 1.0, 0.3))
    assert (s.slots, s.serving) == (4, 2)


def ctx(
    metrics: dict[str, dict[str, float]], target: int, now: float, state: Any
) -> Any:
    return SimpleNamespace(
        aggregated_metrics=metrics,
        current_num_replicas=target,
        target_num_replicas=target,
        policy_state=state,
        current_time=now,
    )


def test_serve_policy_reads_the_replicas_latest_view_and_keeps_its_state() -> None:
    late = replace(IDLE, queued=(2, 0, 0), oldest_wait_s=(1.0, 0, 0), running=(0, 6, 0))
    by_name: dict[str, dict[str, float]] = {}
    for name, value in late.as_metrics().items():
        # Two replicas relay the same router; one sampled it before the wait grew.
        by_name[name] = {"r1": value, "r2": value * 0.5}
    policy = ServePolicy(max_replicas=3, slo_ttft_s=[0.5, 2.0], upscale_delay_s=1.0)
    n, state = policy(ctx(by_name, 1, 100.0, {}))
    assert n == 1 and state["moe_cluster"]["reason"] == "wait:realtime_slo"
    n, state = policy(ctx(by_name, 1, 101.0, state))
    assert n == 2 and state["moe_cluster"]["reason"] == "realtime_slo"
    n, _ = policy(ctx({}, 2, 102.0, state))
    assert n == 2  # no replica reported yet: hold
