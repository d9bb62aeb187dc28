import json

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.core import RouterCore
from router.settings import CoreSettings
from router.stats import Percentiles
from router.types import Outcome, Release, ReplicaId, ReplicaReport, Ticket, Transition
from tests.router.clock import Clock
from tests.router.support import submit


def test_percentiles_of_samples() -> None:
    assert Percentiles.of([], 1e3) is None
    p = Percentiles.of([0.001 * i for i in range(1, 101)], 1e3)
    assert p is not None and p.n == 100
    assert p.p50 == 50.5 and round(p.p99, 2) == 99.01


def test_the_snapshot_is_typed_and_prints_as_json() -> None:
    clock = Clock()
    core = RouterCore(CoreSettings.of(RouterConfig()), clock=clock)
    core.report(ReplicaReport(ReplicaId("a"), node_id="n1"))
    submit(core, Ticket("t1", QoS.REALTIME, 8, 4))
    clock.advance(0.2)
    core.release(Release("t1", Outcome.OK, ReplicaId("a"), ttft_s=0.1))
    stats = core.snapshot().with_service(
        (Transition("replica", "a", "closed", "open", 1.0, "3 consecutive failures"),),
        Percentiles(12.0, 30.0, 2),
    )
    assert stats.replicas["a"].node == "n1" and stats.admitted["realtime"] == 1
    assert stats.ttft_ms["realtime"] == Percentiles(100.0, 100.0, 1)
    out = json.loads(json.dumps(stats.as_json()))
    assert out["replicas"]["a"]["running"] == 0
    assert out["ttft_ms"]["realtime"] == {"p50": 100.0, "p99": 100.0, "n": 1}
    assert out["decision_us"] == {"p50": 12.0, "p99": 30.0, "n": 2}
    assert out["transitions"] == [
        {
            "kind": "replica",
            "key": "a",
            "old": "closed",
            "new": "open",
            "why": "3 consecutive failures",
        }
    ]
