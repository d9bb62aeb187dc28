"""``tests.perf.pairs``: the rounds' order, the pairing of points, and the
ratio's geometric mean with its interval (the servers are not started here)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.perf import pairs


def _point(tok_s: float, completed: int = 64) -> dict[str, Any]:
    return {"all": {"output_tok_s": tok_s, "completed": completed}}


def _moe(c1: float, g1: float, c4: float, g4: float) -> dict[str, Any]:
    return {
        "S1": _point(c1),
        "S1g": _point(g1),
        "S1c4": _point(c4),
        "S1gc4": _point(g4),
    }


def _ref(c1: float, c4: float) -> dict[str, Any]:
    return {"S1": _point(c1), "S1c4": _point(c4)}


def test_every_peer_runs_in_every_position_once_per_cycle() -> None:
    keys = ["moe", "vllm", "vllm-nostats"]
    orders = [pairs.rotated(keys, i) for i in range(3)]
    assert orders[0] == keys
    for position in range(3):
        assert sorted(o[position] for o in orders) == sorted(keys)
    assert pairs.rotated(keys, 3) == keys


def test_identical_ratios_have_no_spread() -> None:
    s = pairs.ratio_summary([0.9, 0.9, 0.9])
    assert s["geomean"] == pytest.approx(0.9)
    assert s["ci95_low"] == pytest.approx(0.9)
    assert s["ci95_high"] == pytest.approx(0.9)
    assert (s["min"], s["max"], s["rounds"]) == (0.9, 0.9, 3)


def test_interval_is_student_t_on_the_log_ratios() -> None:
    rs = [0.8, 1.0, 1.1, 0.95]
    logs = [math.log(r) for r in rs]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    half = 3.182 * sd / 2  # t(0.975, 3 df) * sd / sqrt(4)
    s = pairs.ratio_summary(rs)
    assert s["geomean"] == pytest.approx(math.exp(mean))
    assert s["ci95_low"] == pytest.approx(math.exp(mean - half))
    assert s["ci95_high"] == pytest.approx(math.exp(mean + half))
    assert s["ci95_low"] < 0.8 < 1.1 < s["ci95_high"]  # four draws: a wide interval


def test_one_ratio_has_no_interval_and_bad_ratios_are_refused() -> None:
    s = pairs.ratio_summary([1.2])
    assert s["geomean"] == pytest.approx(1.2)
    assert math.isnan(s["ci95_low"]) and math.isnan(s["ci95_high"])
    with pytest.raises(ValueError, match="positive"):
        pairs.ratio_summary([1.0, 0.0])
    with pytest.raises(ValueError, match="positive"):
        pairs.ratio_summary([])
    with pytest.raises(ValueError, match="two or more"):
        pairs.t95(0)


def test_each_point_is_held_against_the_reference_http_point_of_its_round() -> None:
    rounds = [
        {"moe": _moe(90, 99, 300, 330), "vllm": _ref(100, 300)},
        {"moe": _moe(110, 120, 280, 290), "vllm": _ref(100, 400)},
        # A round in which the reference failed pairs nothing.
        {"moe": _moe(50, 50, 50, 50), "vllm": {"error": "did not start"}},
        # A point with no completed request pairs nothing either.
        {
            "moe": _moe(100, 100, 100, 100) | {"S1g": _point(0.0, completed=0)},
            "vllm": _ref(100, 100),
        },
    ]
    got = pairs.ratios(rounds, "vllm")
    assert got["c=1 HTTP"] == pytest.approx([0.9, 1.1, 1.0])
    assert got["c=1 gRPC"] == pytest.approx([0.99, 1.2])
    assert got["c=4 HTTP"] == pytest.approx([1.0, 0.7, 1.0])
    assert got["c=4 gRPC"] == pytest.approx([1.1, 0.725, 1.0])


def test_the_table_lists_each_round_and_the_summary_per_reference() -> None:
    rounds = [
        {"moe": _moe(90, 99, 300, 330), "vllm": _ref(100, 300)},
        {"vllm": _ref(120, 330), "moe": _moe(96, 100, 297, 310)},
    ]
    table = pairs.markdown(rounds, ["moe", "vllm"])
    assert "| 1 | moe, vllm | 90.0 | 99.0 | 300.0 | 330.0 | 100.0 | 300.0 |" in table
    assert "| 2 | vllm, moe | 96.0 | 100.0 | 297.0 | 310.0 | 120.0 | 330.0 |" in table
    geomean = math.sqrt(0.9 * 0.8)
    assert f"| moe-cluster | vLLM | c=1 HTTP | {geomean:.3f} |" in table
    assert "| 0.800-0.900 | 2 |" in table


def _s3(tok_s: float, p50: float, p99: float) -> dict[str, Any]:
    point = _point(tok_s, completed=48)
    point["all"]["ttft_ms"] = {"p50": p50, "p99": p99}
    return {"S3": point}


def test_s3_holds_each_moe_cluster_peer_against_each_reference() -> None:
    s3 = pairs.SCENARIOS["S3"]
    rounds = [
        {
            "moe": _s3(200, 250, 600),
            "moe-prefix": _s3(180, 200, 500),
            "rsllm-prefix": _s3(100, 1000, 2000),
            "rsllm": _s3(160, 500, 1000),
        },
        {
            "moe": _s3(150, 300, 900),
            "moe-prefix": {"error": "did not start"},
            "rsllm-prefix": _s3(150, 600, 1800),
            "rsllm": _s3(100, 400, 1200),
        },
    ]
    got = pairs.ratios(rounds, "rsllm-prefix", s3)
    assert got["tok/s"] == pytest.approx([2.0, 1.0])
    assert got["TTFT p50"] == pytest.approx([0.25, 0.5])
    assert got["TTFT p99"] == pytest.approx([0.3, 0.5])
    prefix = pairs.ratios(rounds, "rsllm", s3, subject="moe-prefix")
    assert prefix == {"tok/s": [1.125], "TTFT p50": [0.4], "TTFT p99": [0.5]}

    keys = ["moe", "moe-prefix", "rsllm-prefix", "rsllm"]
    table = pairs.markdown(rounds, keys, s3)
    # Subjects show every point; a reference shows each of its figures once.
    assert "| 1 | moe, moe-prefix, rsllm-prefix, rsllm | 200.0 | 250.0 | 600.0 |" in (
        table
    )
    assert "| 2 | moe-prefix, rsllm-prefix, rsllm, moe | 150.0 |" in table
    assert "| - | - | - | 150.0 | 600.0 | 1800 | 100.0 | 400.0 | 1200 |" in table
    both = math.sqrt(0.3 * 0.5)
    assert (
        f"| moe-cluster | Ray Serve LLM + prefix router | TTFT p99 | {both:.3f} |"
        in table
    )
    # One round only: a geometric mean, no interval.
    assert "| moe-cluster, prefix policy | Ray Serve LLM | tok/s | 1.125 | - |" in (
        table
    )


def test_a_metric_the_harness_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown metric"):
        pairs.value(_s3(1, 1, 1), "S3", "tpot_p50")
    assert pairs.value(_s3(1, 1, 1), "S2", "ttft_p99") is None


def test_a_label_names_the_result_files_beside_the_others() -> None:
    plain = pairs.result_stem("S1")
    assert plain.startswith("s1_pairs-")
    assert pairs.result_stem("S1", "uni-2") == f"{plain}-uni-2"
    for bad in ("../peers", "a b", "x/y", "."):
        with pytest.raises(ValueError, match="letters, digits"):
            pairs.result_stem("S1", bad)
