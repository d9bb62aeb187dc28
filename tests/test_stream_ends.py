"""``tests.perf.stream_ends``' arithmetic on the client's timings."""

from __future__ import annotations

import pytest

from tests.perf.stream_ends import (
    Timed,
    next_set_first_tokens,
    sets,
    summary,
    turnovers,
)

# Two streams, two sets: the first ends at 1.000 / 1.010, the second set's first
# tokens come at 1.050 and 1.060; a third request of a set ends 0.1 s later.
TIMED = [
    Timed(0, 0.0, 0.04, 1.000, 1.001),
    Timed(1, 0.0, 0.05, 1.010, 1.014),
    Timed(0, 1.001, 1.050, 2.000, 2.0005),
    Timed(1, 1.014, 1.060, 2.100, 2.1005),
]


def test_streams_that_end_together_are_one_set() -> None:
    groups = sets(TIMED)
    assert [[t.last for t in g] for g in groups] == [[1.0, 1.01], [2.0], [2.1]]


def test_a_sets_turnover_runs_from_its_last_token_to_the_next_first() -> None:
    # 1.010 -> 1.050; the later sets have no first token after them.
    assert turnovers(TIMED) == pytest.approx([0.040])


def test_the_next_sets_first_token_counts_from_its_first_request_sent() -> None:
    # Sent at 1.001 and 1.014 after the first set began to end at 1.000; the
    # first token of the two came at 1.050. The later sets have no successors.
    assert next_set_first_tokens(TIMED) == pytest.approx([0.049])


def test_the_summary_reads_each_requests_times() -> None:
    s = summary(TIMED, tokens=64)
    assert s["requests"] == 4 and s["sets"] == 3
    assert s["output_tok_s"] == pytest.approx(4 * 64 / 2.1005)
    ends = s["last_token_to_end"]
    assert isinstance(ends, dict)
    assert ends["p50"] == pytest.approx(1.0)  # ms: 0.5, 0.5, 1, 4
    assert s["set_spread"] == {"p10": 0.0, "p50": 0.0, "p90": pytest.approx(10.0)}
    tpot = s["tpot"]
    assert isinstance(tpot, dict)
    assert tpot["p10"] == pytest.approx(950 / 63)  # ms: 1.050 to 2.000, 63 tokens
