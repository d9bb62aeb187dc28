from typing import Any

from deployments.engine.pinned_router import PinnedRequestRouter, target_of
from deployments.protocol import EngineRequest, Pin, Sampling


class _Replica:
    def __init__(self, rid: str) -> None:
        self.replica_id = type("Id", (), {"unique_id": rid})()


class _Pending:
    def __init__(self, *args: Any) -> None:
        self.args = list(args)


async def test_pinned_requests_go_to_their_replica_and_others_spread() -> None:
    router = PinnedRequestRouter.__new__(PinnedRequestRouter)  # no Serve state needed
    replicas: list[Any] = [_Replica(r) for r in ("a", "b", "c")]
    req = EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id="b")
    assert target_of(_Pending(req)) == "b"  # type: ignore[arg-type]
    assert await router.choose_replicas(replicas, _Pending(req)) == [[replicas[1]]]  # type: ignore[arg-type]
    # A call without a request (stats) is pinned by a Pin.
    assert await router.choose_replicas(replicas, _Pending(Pin("c"))) == [[replicas[2]]]  # type: ignore[arg-type]
    gone = EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id="z")
    [fallback] = await router.choose_replicas(replicas, _Pending(gone))  # type: ignore[arg-type]
    assert len(fallback) == 2 and set(fallback) <= set(replicas)
    firsts = set()
    for _ in range(200):  # unpinned calls (stats, aborts) do not stick to one
        [pick] = await router.choose_replicas(replicas, _Pending())  # type: ignore[arg-type]
        firsts.add(pick[0].replica_id.unique_id)
    assert firsts == {"a", "b", "c"}
