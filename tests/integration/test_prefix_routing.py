"""The prefix policy driven by the engines' own prefix caches (vLLM KV events).

A second app beside the session's: ``router.policy: prefix`` and no page store,
so the only thing that tells the router where a prefix lives is each engine's
KV event stream. Needs an engine that caches prefixes itself (AMX_MLA here;
vLLM forces the cache off on the reference CPU_MLA backend).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.platform import has_amx
from tests.integration.conftest import (
    Served,
    another_app,
    app_settings,
    wait_until,
)
from tests.integration.test_grpc import greedy, run
from tests.integration.test_kvstore import unique_prompt
from tests.integration.test_router import router_snapshot


@pytest.fixture(scope="module")
def prefix_app(served: Served, tiny_model: Path) -> Iterator[Served]:
    if not has_amx():
        pytest.skip(
            "no AMX on this CPU: the reference CPU_MLA backend keeps no prefix "
            "cache of its own, and routing by it needs AMX_MLA (or a GPU)"
        )
    settings = app_settings(
        tiny_model,
        engine={"attention_backend": "AMX_MLA"},
        router={"policy": "prefix", "prefix_balance_tokens": 1 << 20},
        kvstore={"enabled": False},
        server={"app_name": "moe-cluster-prefix"},
    )
    with another_app(served, settings) as app:
        assert app.config.engine.enable_prefix_caching
        yield app


def test_requests_follow_the_replica_whose_engine_cached_their_prefix(
    prefix_app: Served,
) -> None:
    block = prefix_app.config.engine.kv_block_size
    wait_until(lambda: len(router_snapshot(prefix_app).replicas) == 2, 60, "2 replicas")

    def blocks(replica: str) -> int:
        return int(router_snapshot(prefix_app).replicas[replica].cached_blocks)

    for shared in (unique_prompt(4 * block), unique_prompt(4 * block)):
        held = {r: blocks(r) for r in router_snapshot(prefix_app).replicas}
        _, first, _ = run(prefix_app, greedy(shared + unique_prompt(5), 2))
        home = first.replica_id

        # Its 4 full blocks reach the router in the engine's KV events.
        def known(home: str = home, before: int = held[home]) -> bool:
            return blocks(home) >= before + 4

        wait_until(known, 20, "the engine's KV events in the router")
        for _ in range(4):
            _, fin, _ = run(prefix_app, greedy(shared + unique_prompt(7), 2))
            assert fin.replica_id == home
            assert fin.cached_tokens == 4 * block  # the engine's own cache
    snap = router_snapshot(prefix_app)
    assert snap.routed.get("prefix", 0) == 8, snap.routed
    # 8 of the 10 requests found their 4 blocks where they were sent.
    assert snap.prefix_hit_rate == pytest.approx(8 * 4 / (10 * 4))
