"""Chaos: kill each component in turn under steady mixed-QoS greedy load.

    make chaos     # every row, on the session's 2-replica cluster (~6 min)

For each component: requests lost (no answer at all), streams failed (an error
status), streams with wrong tokens (greedy streams against the tiny model's
uninterrupted answer: a gap, a duplicate or a wrong token anywhere), the time to
recover (from the kill to the first token of a probe: one-token requests sent one
after another from the kill on), and the TTFT of the load's requests sent in the
10 s after the kill. The table is
printed and written to ``tests/perf/results/chaos.md``.

Goal: 0 lost, 0 failed, 0 wrong for every row but the ingress replica's, which
holds its clients' connections: its own streams may fail (its figure is given).
Opt-in (``-m chaos``): each row waits for the cluster to heal, which takes
Serve's replica restarts.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import psutil
import pytest
import ray

from cluster.platform import has_amx
from deployments.proto import inference_pb2 as pb
from kvstore import actor as kv_actor
from router import actor as router_actor
from tests.integration.conftest import PLATFORM, Served, engine_stats, wait_until
from tests.integration.test_router import router_snapshot
from tests.perf.compare_peers import RESULTS

pytestmark = pytest.mark.chaos
RUN_LAST = True

PROMPTS = [[410 + i, 465, 14, 7 + i] for i in range(6)]
QOS = [pb.REALTIME, pb.NORMAL, pb.BACKGROUND]
MAX_TOKENS = 96
STREAMS = 6  # closed loop: each sends its next request when one ends
BEFORE_S, WINDOW_S = 3.0, 10.0


@dataclass
class Outcome:
    sent_at: float
    prompt: int
    code: grpc.StatusCode | None = None  # None: no answer at all (lost)
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    migrations: int = 0


@dataclass
class Row:
    component: str
    requests: int
    lost: int
    failed: int
    wrong: int
    recovery_s: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    migrated: int


ROWS: list[Row] = []


def _request(i: int, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPTS[i]),
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        qos=QOS[i % len(QOS)],
    )


def _one(served: Served, i: int, max_tokens: int = MAX_TOKENS) -> Outcome:
    out = Outcome(time.monotonic(), i)
    client = served.client()
    try:
        for msg in client.generate(_request(i, max_tokens), timeout=120):
            if msg.HasField("chunk"):
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - out.sent_at
                out.tokens += msg.chunk.token_ids
            elif msg.HasField("finished"):
                out.migrations = msg.finished.migrations
        out.code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        out.code = e.code() if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED else None
    finally:
        client.close()
    return out


@pytest.fixture(scope="module")
def reference(served: Served) -> dict[int, list[int]]:
    """Each prompt's uninterrupted greedy tokens."""
    answers = {i: _one(served, i) for i in range(len(PROMPTS))}
    assert all(len(a.tokens) == MAX_TOKENS for a in answers.values())
    return {i: a.tokens for i, a in answers.items()}


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
    for r in ROWS:
        ttft = (
            f"{r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f} ms"
            if r.ttft_p50_ms is not None
            else "-"
        )
        rec = f"{r.recovery_s:.2f} s" if r.recovery_s is not None else "-"
        lines.append(
            f"| {r.component} | {r.requests} | {r.lost} | {r.failed} | {r.wrong} | "
            f"{r.migrated} | {rec} | {ttft} |"
        )
    text = "\n".join(lines)
    print("\n" + text)
    (RESULTS / "chaos.md").write_text(
        "# Chaos: one component killed under steady mixed-QoS greedy load\n\n"
        f"{STREAMS} closed-loop gRPC streams, {MAX_TOKENS} greedy tokens each, "
        "realtime/normal/background in turn, on the test session's 2-replica "
        f"cluster (`make chaos`). Engines: {PLATFORM.describe()}; CPU: "
        f"{'AMX' if has_amx() else 'no AMX'}.\n\n" + text + "\n"
    )


def _healthy(served: Served, engine_handle: Any) -> None:
    wait_until(lambda: len(engine_stats(engine_handle)) == 2, 180, "2 engine replicas")
    wait_until(
        lambda: len(router_snapshot(served).replicas) == 2, 60, "the router's view"
    )
    wait_until(
        lambda: _one(served, 0).code == grpc.StatusCode.OK, 120, "a request served"
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


KILLS: list[tuple[str, Callable[[Served, Any], None]]] = [
    ("vLLM engine process", _kill_engine_process),
    ("engine replica actor", _kill_engine_replica),
    ("router actor", _kill_router),
    ("node page store actor", _kill_store),
    ("page store directory actor", _kill_directory),
    ("ingress replica", _kill_ingress),
]


@pytest.mark.parametrize(("component", "kill"), KILLS, ids=[k[0] for k in KILLS])
def test_component_killed_under_load(
    served: Served,
    engine_handle: Any,
    reference: dict[int, list[int]],
    component: str,
    kill: Callable[[Served, Any], None],
) -> None:
    _healthy(served, engine_handle)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()

    def loop(k: int) -> None:
        i = k
        while not stop.is_set():
            out = _one(served, i % len(PROMPTS))
            with lock:
                outcomes.append(out)
            i += STREAMS

    threads = [
        threading.Thread(target=loop, args=(k,), daemon=True) for k in range(STREAMS)
    ]
    for t in threads:
        t.start()
    time.sleep(BEFORE_S)
    kill(served, engine_handle)
    killed_at = time.monotonic()
    recovered_at: float | None = None
    while recovered_at is None and time.monotonic() - killed_at < 120:
        probe = _one(served, 0, max_tokens=1)
        if probe.code == grpc.StatusCode.OK and probe.ttft_s is not None:
            recovered_at = probe.sent_at + probe.ttft_s
    time.sleep(max(0.0, killed_at + WINDOW_S - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(150)
    after = [o for o in outcomes if o.sent_at >= killed_at]
    ttfts = sorted(o.ttft_s * 1000 for o in after if o.ttft_s is not None)
    ok = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    row = Row(
        component,
        len(outcomes),
        lost=sum(o.code is None for o in outcomes),
        failed=sum(o.code not in (None, grpc.StatusCode.OK) for o in outcomes),
        wrong=sum(o.tokens != reference[o.prompt] for o in ok),
        recovery_s=None if recovered_at is None else recovered_at - killed_at,
        ttft_p50_ms=statistics.median(ttfts) if ttfts else None,
        ttft_p99_ms=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        if ttfts
        else None,
        migrated=sum(o.migrations > 0 for o in ok),
    )
    ROWS.append(row)
    print(row)
    assert row.wrong == 0
    if component != "ingress replica":  # it holds its own clients' connections
        assert (row.lost, row.failed) == (0, 0), row
    _healthy(served, engine_handle)
