"""The QoS-aware autoscaler on a real app: a load step past one replica's
capacity adds a replica (warmed from the page store before it takes traffic),
and the idle that follows stops it again, with no failed request.

The app runs beside the session's (its own engines, router and page store),
with the quick settings of ``tests/perf/autoscale.py`` (``make bench-autoscale``
prints the figures).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Served, another_app
from tests.perf import autoscale

RUN_LAST = True  # a third and fourth engine on the session's cores


@pytest.fixture(scope="module")
def scaled_app(served: Served, tiny_model: Path) -> Iterator[Served]:
    settings = autoscale.settings(str(tiny_model), "moe-cluster-autoscale")
    with another_app(served, settings) as app:
        yield app


def test_a_load_step_scales_one_replica_to_two_and_back(scaled_app: Served) -> None:
    app = scaled_app.config.server.app_name
    client = scaled_app.client()
    try:
        autoscale._one(client, "first", 0, autoscale.StepRun())  # puts HOT in the store
        slots = scaled_app.config.router.max_running_per_replica
        run = autoscale.run_step(client, app, 2 * slots, settle_s=2, limit_s=180)
    finally:
        client.close()
    result = autoscale.summary(run)
    print(result)
    assert not run.failed(), run.failed()[:3]
    counts = [n for _, n in run.replicas]
    assert counts[0] == 1 and max(counts) == 2 and counts[-1] == 1
    # The step's pressure scaled it, and the new replica served during the step.
    assert "step_to_new_replica_s" in result
    # It warmed the hot prefix from the page store before its first request.
    assert result["new_replica_first"]["cached"] >= autoscale.PREFIX // 2
