"""The key serving paths on both of vLLM's CPU MLA attention backends, one run.

The session's app runs what ``engine.attention_backend: auto`` gives on this CPU
(``PLATFORM``). Where that is AMX_MLA, this module deploys a second app beside it
with the reference backend forced (``attention_backend: CPU_MLA``: float32,
16-token blocks, no engine prefix cache), so one AMX machine covers both paths
(and with the session forced to CPU_MLA, the second app is the AMX one). On a
CPU without AMX the session's app is the reference path and the AMX path cannot
run: its half of these tests skips, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve

from cluster.config import ClusterConfig
from cluster.platform import Backend, has_amx
from cluster.tiny_model import greedy_chain, greedy_successors
from kvstore import actor as kv_actor
from tests.integration.conftest import (
    PLATFORM,
    Served,
    another_app,
    app_settings,
    engine_stats,
    page_bytes,
    wait_until,
)
from tests.integration.test_grpc import PROMPT_IDS, greedy, run
from tests.integration.test_kvstore import generate, unique_prompt

OTHER = Backend.CPU_MLA if PLATFORM.backend is Backend.AMX_MLA else Backend.AMX_MLA


def other_runs_here() -> bool:
    return OTHER is Backend.CPU_MLA or has_amx()


@pytest.fixture(scope="module")
def other(served: Served, tiny_model: Path) -> Iterator[Served]:
    if not other_runs_here():
        pytest.skip(
            "this CPU has no AMX: the AMX_MLA path (bfloat16, 128-token blocks, "
            "vLLM's prefix cache on) cannot run here; an AMX machine runs it"
        )
    engine = {"attention_backend": OTHER.value}
    platform = ClusterConfig.model_validate(
        app_settings(tiny_model, engine=engine)
    ).engine_platform()
    settings = app_settings(
        tiny_model,
        engine=engine,
        kvstore={"capacity_bytes": 64 * page_bytes(platform)},
        server={"app_name": "moe-cluster-other-backend"},
    )
    with another_app(served, settings) as app:
        yield app


@pytest.fixture(params=["this CPU's backend", "the other backend"])
def path(request: pytest.FixtureRequest) -> Served:
    name = "served" if request.param.startswith("this") else "other"
    app: Served = request.getfixturevalue(name)
    return app


def _engines(app: Served) -> tuple[Any, dict[str, Any]]:
    handle = serve.get_deployment_handle("Engine", app.config.server.app_name)
    stats = wait_until(
        lambda: s if len(s := engine_stats(handle)) == 2 else None, 60, "2 replicas"
    )
    return handle, stats


def test_the_session_runs_the_backend_it_resolved_to(served: Served) -> None:
    e = served.config.engine
    assert (e.attention_backend, e.dtype) == (PLATFORM.backend.value, PLATFORM.dtype)
    assert e.kv_block_size == PLATFORM.block_size
    expected = (
        ("AMX_MLA", "bfloat16", 128, True)
        if PLATFORM.backend is Backend.AMX_MLA
        else ("CPU_MLA", "float32", 16, False)
    )
    assert (
        PLATFORM.backend.value,
        PLATFORM.dtype,
        PLATFORM.block_size,
        PLATFORM.prefix_caching,
    ) == expected


def test_engines_run_the_backend_their_config_resolved_to(path: Served) -> None:
    _, stats = _engines(path)
    e = path.config.engine
    for s in stats.values():
        assert (s.attention_backend, s.dtype, s.block_size) == (
            e.attention_backend,
            e.dtype,
            e.kv_block_size,
        )
        assert s.prefix_caching == e.enable_prefix_caching
        assert s.prefix_caching == (e.attention_backend == "AMX_MLA")


def test_generate_streams_the_models_greedy_tokens(
    path: Served, tiny_model: Path
) -> None:
    tokens, fin, chunks = run(path, greedy(PROMPT_IDS, 16))
    successor = greedy_successors(tiny_model)
    assert tokens == greedy_chain(successor, PROMPT_IDS[-1], 16)
    assert chunks >= 2 and fin.finish_reason == "length"


def test_a_prefix_is_reused_across_replicas_and_counted_where_it_is_served(
    path: Served,
) -> None:
    app = path
    handle, stats = _engines(app)
    a, b = sorted(stats)
    block = app.config.engine.kv_block_size
    (store,) = kv_actor.stores(app.config.server.app_name).values()
    hits = lambda: ray.get(store.summary.remote())["hit_pages"]  # noqa: E731
    prompt = unique_prompt(4 * block + 1)
    cold = generate(handle, a, prompt)
    assert cold.finish.cached_tokens == 0
    before = hits()
    loaded = generate(handle, b, prompt)  # B's engine never saw it: the store
    assert loaded.finish.cached_tokens == 4 * block
    assert loaded.tokens == cold.tokens
    assert hits() - before == 4
    again = generate(handle, b, prompt)
    assert again.finish.cached_tokens == 4 * block
    # A caching engine serves the prefix itself: the store is asked for (and
    # counts) only what it adds, which here is nothing.
    added = 0 if app.config.engine.enable_prefix_caching else 4
    assert hits() - before == 4 + added
