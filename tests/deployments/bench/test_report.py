from __future__ import annotations

import math

import pytest

from deployments.bench.report import Slo, latency_stats, summarize, table
from deployments.bench.runner import RequestRecord


def rec(
    index: int,
    qos: str,
    sent: float,
    chunks: list[float],
    end: float,
    out: int,
    cached: int | None = 0,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        index,
        qos,
        prompt_tokens=10,
        max_tokens=out,
        prefix_group=None,
        due_s=sent,
        sent_s=sent,
        chunk_times=chunks,
        chunk_tokens=[1] * len(chunks),
        end_s=end,
        output_tokens=out,
        cached_tokens=cached,
        error=error,
    )


def test_latency_stats_interpolate_linearly_in_ms() -> None:
    stats = latency_stats([0.001, 0.002, 0.003, 0.004])
    assert stats["mean"] == pytest.approx(2.5) and stats["p50"] == pytest.approx(2.5)
    assert stats["p90"] == pytest.approx(3.7)
    assert all(math.isnan(v) for v in latency_stats([]).values())


RECORDS = [
    # ttft 0.1, tpot (0.4 - 0.1) / 3 = 0.1, itls 0.1
    rec(0, "realtime", 0.0, [0.1, 0.2, 0.3, 0.4], 0.4, 4, cached=5),
    # ttft 0.5, tpot (1.0 - 0.5) / 1 = 0.5
    rec(1, "background", 0.0, [0.5, 1.0], 1.0, 2, cached=0),
    rec(2, "background", 0.5, [], 0.6, 0, error="RESOURCE_EXHAUSTED"),
]


def test_summary_is_exact() -> None:
    s = summarize(RECORDS, duration_s=2.0, slo=Slo(ttft_ms=200))
    a = s["all"]
    assert (a["requests"], a["completed"]) == (3, 2)
    assert a["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert a["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert a["tpot_ms"]["p50"] == pytest.approx(300.0)
    assert a["itl_ms"]["p50"] == pytest.approx(100.0)  # [100, 100, 100, 500]
    assert a["e2e_ms"]["p99"] == pytest.approx(994.0)
    assert a["output_tok_s"] == 3.0 and a["total_tok_s"] == 13.0
    assert a["request_rate"] == 1.0
    assert a["goodput"] == 0.5  # only the realtime request meets 200 ms TTFT
    assert a["cached_prompt_share"] == 0.25
    assert s["realtime"]["completed"] == 1 and s["background"]["errors"]
    assert "RESOURCE_EXHAUSTED x1" in table(s)


def test_slo() -> None:
    fast, slow, failed = RECORDS
    assert Slo().met_by(fast) and Slo().met_by(slow) and not Slo().met_by(failed)
    assert Slo(tpot_ms=200).met_by(fast) and not Slo(tpot_ms=200).met_by(slow)


def test_tokens_per_second_counts_what_the_server_counted() -> None:
    from deployments.bench.plots import tokens_per_second

    # Two SSE events recorded as one token each, but the server produced 6.
    batched = rec(3, "normal", 0.0, [0.5, 1.5], 1.6, 6)
    batched.chunk_tokens = [1, 1]
    exact = rec(4, "normal", 0.0, [0.2, 0.4, 2.1], 2.2, 3)
    assert tokens_per_second([batched, exact]) == [5.0, 3.0, 1.0]
    assert tokens_per_second([]) == [0.0]
