"""How ``tests.perf.first_token`` turns CPU time into a fixed cost a request."""

from __future__ import annotations

import pytest

from tests.perf.first_token import per_request


def test_a_requests_cpu_is_what_serving_it_added_to_idle() -> None:
    used = {"ingress": 1.0, "gcs": 0.1, "engine": 3.0}  # seconds over the run
    idle = {"ingress": 0.1, "gcs": 0.05}  # seconds a second, serving nothing
    ms = per_request(used, idle, wall_s=5.0, requests=100)
    assert ms["ingress"] == pytest.approx(5.0)  # (1.0 - 0.1 * 5) / 100 s
    assert ms["engine"] == pytest.approx(30.0)  # no idle use to subtract
    assert ms["gcs"] == 0.0  # used less than idle: nothing a request
    assert list(ms) == ["engine", "ingress", "gcs"]  # most first
