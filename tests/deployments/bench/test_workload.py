from __future__ import annotations

import itertools

import pytest

from deployments.bench.workload import ClassSpec, LengthRange, PrefixGroups, Workload


def take(workload: Workload, n: int, rate: float | None = None) -> list:
    return list(itertools.islice(workload.requests(rate), n))


def test_same_seed_same_requests() -> None:
    w = Workload(seed=7, classes=(ClassSpec(input_len=LengthRange(4, 40)),))
    assert take(w, 50) == take(w, 50)
    assert take(w, 50) != take(Workload(seed=8, classes=w.classes), 50)


def test_lengths_stay_in_range_and_vocab() -> None:
    spec = ClassSpec(input_len=LengthRange(5, 9), output_len=LengthRange(2, 3))
    reqs = take(Workload(classes=(spec,), vocab=(10, 20)), 300)
    assert {len(r.prompt) for r in reqs} == {5, 6, 7, 8, 9}
    assert {r.max_tokens for r in reqs} == {2, 3}
    assert all(10 <= t < 20 for r in reqs for t in r.prompt)
    assert [r.index for r in reqs] == list(range(300))
    assert {r.arrival_s for r in reqs} == {0.0}  # closed loop


def test_shared_prefix_groups() -> None:
    w = Workload(
        classes=(ClassSpec(input_len=LengthRange(3, 3)),), prefix=PrefixGroups(2, 16)
    )
    reqs = take(w, 100)
    assert {r.prefix_group for r in reqs} == {0, 1}
    for group in (0, 1):
        heads = {r.prompt[:16] for r in reqs if r.prefix_group == group}
        assert len(heads) == 1
    assert all(len(r.prompt) == 19 for r in reqs)
    assert len({r.prompt[16:] for r in reqs}) > 90  # distinct suffixes


def test_class_shares() -> None:
    w = Workload(
        classes=(ClassSpec("realtime", share=1), ClassSpec("background", share=3))
    )
    reqs = take(w, 4000)
    share = sum(r.qos == "background" for r in reqs) / len(reqs)
    assert 0.72 < share < 0.78


def test_open_loop_poisson_rates_per_class() -> None:
    w = Workload(
        classes=(ClassSpec("realtime", rate=2.0), ClassSpec("background", rate=8.0))
    )
    reqs = take(w, 20000)
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    span = arrivals[-1]
    rt = sum(r.qos == "realtime" for r in reqs)
    assert rt / span == pytest.approx(2.0, rel=0.05)
    assert (len(reqs) - rt) / span == pytest.approx(8.0, rel=0.05)


def test_a_total_rate_is_split_by_share() -> None:
    w = Workload(
        classes=(ClassSpec("normal", share=1), ClassSpec("background", share=1))
    )
    reqs = take(w, 10000, rate=10.0)
    assert len(reqs) / reqs[-1].arrival_s == pytest.approx(10.0, rel=0.05)


def test_open_loop_needs_every_rate() -> None:
    w = Workload(classes=(ClassSpec("realtime", rate=1.0), ClassSpec("normal")))
    with pytest.raises(ValueError, match="rate"):
        take(w, 1)


def test_parsing() -> None:
    default = ClassSpec(input_len=LengthRange(8, 8))
    spec = ClassSpec.parse("realtime:share=0.2,rate=3,output=4:9", default)
    assert spec == ClassSpec("realtime", 0.2, 3.0, LengthRange(8, 8), LengthRange(4, 9))
    assert LengthRange.parse("12") == LengthRange(12, 12)
    assert ClassSpec.parse("realtime:deadline=500", default).deadline_ms == 500
    bad_ones = ("urgent", "normal:share", "normal:speed=2", "normal:share=-1")
    for bad in (*bad_ones, "normal:deadline=-3"):
        with pytest.raises(ValueError):
            ClassSpec.parse(bad, default)
    with pytest.raises(ValueError):
        LengthRange.parse("9:3")
