"""Chaos: kill each component in turn under steady mixed-QoS greedy load.

    make chaos     # every row (~10 min)

Each row kills one component of the session's 2-replica cluster under the load of
``tests/chaos/load.py`` and counts what its clients saw there; the last row loses a
whole worker node of an in-process 2-node cluster (``tests/chaos/worker_node.py``,
in a child process). The table is printed and written to
``tests/perf/results/chaos.md``.

Goal: 0 lost, 0 failed, 0 wrong for every row but the ingress replica's, which
holds its clients' connections: its own streams may fail (its figure is given).
Opt-in (``-m chaos``): each row waits for the cluster to heal, which takes
Serve's replica restarts.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import ray

from cluster.platform import has_amx
from kvstore import actor as kv_actor
from router import actor as router_actor
from tests.chaos import load
from tests.chaos.load import Row
from tests.integration.conftest import PLATFORM, Served, engine_stats, wait_until
from tests.integration.test_router import router_snapshot
from tests.otlp_receiver import untraced_env
from tests.perf.compare_peers import RESULTS

pytestmark = pytest.mark.chaos
RUN_LAST = True

ROWS: list[Row] = []


@pytest.fixture(scope="module")
def reference(served: Served) -> dict[int, list[int]]:
    """Each prompt's uninterrupted greedy tokens."""
    return load.reference(served.client)


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    if not ROWS:
        return
    lines = [
        "| component killed | requests | lost | failed | wrong tokens | migrated | "
        "recovery | TTFT p50 / p99 in the 10 s after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [r.line() for r in ROWS]
    text = "\n".join(lines)
    print("\n" + text)
    (RESULTS / "chaos.md").write_text(
        "# Chaos: one component killed under steady mixed-QoS greedy load\n\n"
        f"{load.STREAMS} closed-loop gRPC streams, {load.MAX_TOKENS} greedy tokens "
        "each, realtime/normal/background in turn, on the test session's "
        "2-replica cluster, and (last row) on an in-process 2-node cluster with "
        f"one engine replica per node (`make chaos`). Engines: "
        f"{PLATFORM.describe()}; CPU: "
        f"{'AMX' if has_amx() else 'no AMX'}.\n\n" + text + "\n"
    )


def _healthy(served: Served, engine_handle: Any) -> None:
    wait_until(lambda: len(engine_stats(engine_handle)) == 2, 180, "2 engine replicas")
    wait_until(
        lambda: len(router_snapshot(served).replicas) == 2, 60, "the router's view"
    )
    wait_until(
        lambda: load.one(served.client, 0).code == grpc.StatusCode.OK,
        120,
        "a request served",
    )


def _replica_actor(app: str, deployment: str, replica_id: str) -> Any:
    return ray.get_actor(
        f"SERVE_REPLICA::{app}#{deployment}#{replica_id}", namespace="serve"
    )


def _kill_engine_process(served: Served, engine_handle: Any) -> None:
    victim = next(iter(engine_stats(engine_handle).values()))
    for child in psutil.Process(victim.pid).children(recursive=True):
        child.kill()


def _kill_engine_replica(served: Served, engine_handle: Any) -> None:
    rid = next(iter(engine_stats(engine_handle)))
    app = served.config.server.app_name
    ray.kill(_replica_actor(app, "Engine", rid), no_restart=True)


def _kill_router(served: Served, engine_handle: Any) -> None:
    name = router_actor.actor_name(served.config.server.app_name)
    ray.kill(ray.get_actor(name, namespace=router_actor.NAMESPACE), no_restart=False)


def _kill_store(served: Served, engine_handle: Any) -> None:
    store = next(iter(kv_actor.stores(served.config.server.app_name).values()))
    ray.kill(store, no_restart=True)  # the engines start a new one


def _kill_directory(served: Served, engine_handle: Any) -> None:
    name = kv_actor.directory_name(served.config.server.app_name)
    ray.kill(ray.get_actor(name, namespace=kv_actor.NAMESPACE), no_restart=False)


def _kill_ingress(served: Served, engine_handle: Any) -> None:
    app = served.config.server.app_name
    ingress = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve"
        and a["name"].startswith(f"SERVE_REPLICA::{app}#Ingress#")
    ]
    ray.kill(ray.get_actor(ingress[0]["name"], namespace="serve"), no_restart=True)


def _redeploy(served: Served, engine_handle: Any) -> None:
    """Runs the app again (what ``serve.run`` of a new version does): Serve
    replaces every replica, a few at a time; each stopped engine replica drains
    and hands its streams off, each stopped ingress replica finishes its own."""
    from deployments.app import deploy

    before = set(engine_stats(engine_handle))
    redeploying = threading.Thread(
        target=deploy, args=(served.config,), kwargs={"external_scaler": True}
    )
    redeploying.start()
    REDEPLOYS.append((redeploying, before))


KILLS: list[tuple[str, Callable[[Served, Any], None]]] = [
    ("vLLM engine process", _kill_engine_process),
    ("engine replica actor", _kill_engine_replica),
    ("router actor", _kill_router),
    ("node page store actor", _kill_store),
    ("page store directory actor", _kill_directory),
    ("ingress replica", _kill_ingress),
    ("the whole app redeployed", _redeploy),
]
REDEPLOYS: list[tuple[threading.Thread, set[str]]] = []


@pytest.mark.parametrize(("component", "kill"), KILLS, ids=[k[0] for k in KILLS])
def test_component_killed_under_load(
    served: Served,
    engine_handle: Any,
    reference: dict[int, list[int]],
    component: str,
    kill: Callable[[Served, Any], None],
) -> None:
    _healthy(served, engine_handle)
    row = load.kill_under_load(
        component, served.client, reference, lambda: kill(served, engine_handle)
    )
    ROWS.append(row)
    print(row)
    if kill is _redeploy:  # every engine replica was replaced
        redeploying, before = REDEPLOYS.pop()
        redeploying.join(300)
        assert not redeploying.is_alive(), "the redeploy did not finish"
        assert not set(engine_stats(engine_handle)) & before
    assert row.wrong == 0
    if component != "ingress replica":  # it holds its own clients' connections
        assert (row.lost, row.failed) == (0, 0), row
    _healthy(served, engine_handle)


@pytest.mark.timeout(900)
def test_a_whole_worker_node_lost_under_load(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "row.pickle"
    run = subprocess.run(
        [sys.executable, "-m", "tests.chaos.worker_node", str(tiny_model), str(out)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
        env=untraced_env(),
    )
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    row: Row = pickle.loads(out.read_bytes())
    ROWS.append(row)
    print(row)
    assert (row.lost, row.failed, row.wrong) == (0, 0, 0), row
