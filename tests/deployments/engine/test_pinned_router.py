import time
from typing import Any

from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.request_router.common import (
    ReplicaQueueLengthCache,
    RequestRoutingContext,
)

from deployments.engine import pinned_router
from deployments.engine.pinned_router import (
    NEW_REPLICA_WAIT_S,
    PinnedRequestRouter,
    target_of,
)
from deployments.protocol import EngineRequest, Pin, Sampling


class _Replica:
    def __init__(self, rid: str) -> None:
        self.replica_id = type("Id", (), {"unique_id": rid})()


class _Pending:
    def __init__(self, *args: Any, age_s: float = 0.0) -> None:
        self.args = list(args)
        self.created_at = time.time() - age_s
        self.routing_context = RequestRoutingContext()


def _router() -> PinnedRequestRouter:
    router = PinnedRequestRouter.__new__(PinnedRequestRouter)  # no Serve state needed
    router.initialize_state()
    # What Serve's own handlers of a failed call (below) touch.
    router._replicas = {}
    router._replicas_list = []
    router._replica_id_set = set()
    router._queue_len_gauge_last_update = {}
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    return router


def _id(rid: str) -> ReplicaID:
    return ReplicaID(rid, DeploymentID("Engine", "app"))


async def test_pinned_requests_go_to_their_replica_and_others_spread() -> None:
    router = _router()
    replicas: list[Any] = [_Replica(r) for r in ("a", "b", "c")]
    req = EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id="b")
    assert target_of(_Pending(req)) == "b"  # type: ignore[arg-type]
    assert await router.choose_replicas(replicas, _Pending(req)) == [[replicas[1]]]  # type: ignore[arg-type]
    # A call without a request (stats) is pinned by a Pin.
    assert await router.choose_replicas(replicas, _Pending(Pin("c"))) == [[replicas[2]]]  # type: ignore[arg-type]
    router._gone.append("z")  # left this handle's set: stopping or dead
    gone = EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id="z")
    [fallback] = await router.choose_replicas(replicas, _Pending(gone))  # type: ignore[arg-type]
    assert len(fallback) == 2 and set(fallback) <= set(replicas)
    firsts = set()
    for _ in range(200):  # unpinned calls (stats, aborts) do not stick to one
        [pick] = await router.choose_replicas(replicas, _Pending())  # type: ignore[arg-type]
        firsts.add(pick[0].replica_id.unique_id)
    assert firsts == {"a", "b", "c"}


async def test_a_request_placed_on_a_replica_not_seen_yet_waits_for_it() -> None:
    """The router places work on a replica once it is ready; Serve adds it to the
    handles a moment later. Meanwhile the request waits (backing off), and goes
    anywhere only if the replica never comes."""
    router = _router()
    replicas: list[Any] = [_Replica(r) for r in ("a", "b")]
    new = EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id="n")
    pending = _Pending(new)
    assert await router.choose_replicas(replicas, pending) == []  # type: ignore[arg-type]
    assert pending.routing_context.should_backoff  # a retry sleeps, not spins
    here = [*replicas, _Replica("n")]
    assert await router.choose_replicas(here, pending) == [[here[2]]]  # type: ignore[arg-type]
    late = _Pending(new, age_s=NEW_REPLICA_WAIT_S + 0.1)
    [fallback] = await router.choose_replicas(replicas, late)  # type: ignore[arg-type]
    assert set(fallback) == set(replicas)


async def test_a_request_placed_on_a_dead_replica_goes_elsewhere_at_once() -> None:
    """Serve drops a replica a call found dead from this handle's set before
    its controller says so; a request placed there must not wait for it as for
    a replica not seen yet."""
    router = _router()
    replicas: list[Any] = [_Replica(r) for r in ("a", "b")]
    router.on_replica_actor_died(_id("b"))
    placed = EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id="b")
    [fallback] = await router.choose_replicas(replicas[:1], _Pending(placed))  # type: ignore[arg-type]
    assert fallback == [replicas[0]]


async def test_a_replica_found_unavailable_gets_no_request_for_a_while(
    monkeypatch: Any,
) -> None:
    """Over Serve's gRPC transport a dead replica's calls fail as unavailable,
    and Serve keeps it in the handle's set until its controller notices: the
    requests placed there, and calls for anywhere, go to the others meanwhile,
    and to it again once ``UNAVAILABLE_S`` has passed."""
    now = [1000.0]
    monkeypatch.setattr(pinned_router.time, "monotonic", lambda: now[0])
    router = _router()
    replicas: list[Any] = [_Replica(r) for r in ("a", "b", "c")]
    router.on_replica_actor_unavailable(_id("b"))
    placed = EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id="b")
    for _ in range(50):
        [pick] = await router.choose_replicas(replicas, _Pending(placed))  # type: ignore[arg-type]
        assert set(pick) == {replicas[0], replicas[2]}
        [pick] = await router.choose_replicas(replicas, _Pending())  # type: ignore[arg-type]
        assert replicas[1] not in pick
    # The only replica left is tried rather than none.
    assert await router.choose_replicas(replicas[1:2], _Pending()) == [[replicas[1]]]  # type: ignore[arg-type]
    now[0] += pinned_router.UNAVAILABLE_S + 0.1
    assert await router.choose_replicas(replicas, _Pending(placed)) == [[replicas[1]]]  # type: ignore[arg-type]
