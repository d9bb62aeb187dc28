"""The router's shed lines: one each while they are few, a count under a flood."""

from __future__ import annotations

import logging

import pytest

from router.shed_log import ShedLog
from router.types import Shed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _shed(reason: str = "queue-full") -> Shed:
    return Shed(reason, f"refused: {reason}", 1.0)


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> tuple[ShedLog, Clock]:
    caplog.set_level(logging.INFO, logger="test.shed")
    clock = Clock()
    return ShedLog(logging.getLogger("test.shed"), 10.0, 3, clock), clock


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_few_sheds_get_a_line_each(
    log: tuple[ShedLog, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    shed_log, clock = log
    for i in range(3):
        shed_log.shed(f"r{i}", "normal", _shed())
        clock.now += 1
    clock.now += 20
    shed_log.tick()
    assert _lines(caplog) == [
        f"shed r{i} (normal): refused: queue-full" for i in range(3)
    ]


def test_a_flood_is_counted_and_summed_up_when_its_window_ends(
    log: tuple[ShedLog, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    shed_log, clock = log
    for i in range(1000):
        qos, reason = (
            ("background", "deadline") if i % 4 == 0 else ("normal", "queue-full")
        )
        shed_log.shed(f"r{i}", qos, _shed(reason))
        clock.now += 0.005  # 5 s of it
    assert len(caplog.records) == 3  # the burst; the rest held
    shed_log.tick()  # the window is not over yet
    assert len(caplog.records) == 3
    clock.now += 5.1
    shed_log.tick()
    lines = _lines(caplog)
    assert lines[3] == (
        "shed 997 more requests within 10 s without a line each "
        "(background deadline 249, normal queue-full 748)"
    )
    clock.now += 30
    shed_log.tick()
    assert len(caplog.records) == 4  # said once


def test_the_next_window_starts_with_lines_of_its_own_again(
    log: tuple[ShedLog, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    shed_log, clock = log
    for i in range(5):
        shed_log.shed(f"a{i}", "normal", _shed())
    clock.now += 10.0
    shed_log.shed("b0", "realtime", _shed("deadline"))  # ends the first window
    assert _lines(caplog)[3:] == [
        "shed 2 more requests within 10 s without a line each (normal queue-full 2)",
        "shed b0 (realtime): refused: deadline",
    ]


def test_the_summary_line_carries_no_requests_ids(
    log: tuple[ShedLog, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    from cluster import tracing

    shed_log, clock = log
    for i in range(4):
        shed_log.shed(f"a{i}", "normal", _shed())
    clock.now += 10.0
    tracing.REQUEST_ID.set("b0")  # the request whose shed ends the window
    records: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(tracing.REQUEST_ID.get())

    handler = Seen()
    logging.getLogger("test.shed").addHandler(handler)
    try:
        shed_log.shed("b0", "normal", _shed())
    finally:
        logging.getLogger("test.shed").removeHandler(handler)
    assert records == ["", "b0"]  # the summary, then b0's own line
