"""A page held on node 1 is fetched by node 2: two Ray nodes started in-process.

    .venv/bin/python -m tests.kvstore.two_nodes OUT [MODEL_DIR]   # pickles to OUT

Each node runs its own store actor and arena.

1. Stores: a client on node 1 (as the connector is) writes a prompt's pages; one on
   node 2 looks the prompt up, is told to wait while its store fetches the pages
   from node 1's, then finds them locally.
2. Engines (with MODEL_DIR): a vLLM engine on each node, each with the connector to
   its node's store. Node 1's engine computes a prompt; node 2's engine, asked the
   same prompt, loads it (fetched across nodes) instead of recomputing it.

Run in its own process by ``test_two_nodes`` (a process joins one Ray cluster),
which asserts on the ``Fetched`` and ``EnginesRun`` it records.
"""

from __future__ import annotations

import pickle
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from cluster.config import KVStoreConfig
from kvstore import actor as kv_actor
from kvstore.arena import Arena
from kvstore.block_hash import block_hashes
from kvstore.rpc import Fetch, Query, StoreClient, Written

# The engines run what the test session's do (auto, or MOE_CLUSTER_TEST_BACKEND).
from tests.integration.conftest import PLATFORM
from tests.waiting import wait_until

APP = "two-nodes"
ENGINES = "two-nodes-engines"
PAGE = 147456  # one tiny-model page
PAGES = 8
STORE = KVStoreConfig(capacity_bytes=64 * PAGE, sync_interval_s=0.1)
ENGINE_BLOCKS = 6  # full blocks of the prompt node 1 computes and node 2 loads
ENGINE_STORE = KVStoreConfig(capacity_bytes=64 << 20, sync_interval_s=0.1)


@dataclass(frozen=True)
class Fetched:
    """Stores alone: what node 2 found of the pages node 1 wrote."""

    found: int  # pages node 2's lookup returned in the end
    pending_answers: int  # "ask again" answers while its store fetched them
    seconds: float
    bytes_equal: bool  # node 2's copies are node 1's bytes
    imported_pages: int  # node 2's store's count
    stores_on_their_nodes: dict[str, bool]
    distinct_arenas: bool
    fetch: Fetch | None  # the fetch the final lookup reported
    metrics: dict[str, list[str]]  # node 2's moe_cluster_kv_fetch* samples


@dataclass(frozen=True)
class EnginesRun:
    """Engines: node 2's engine asked the prompt node 1's engine computed."""

    node_1_cached: int  # tokens
    node_2_cached: int
    same_tokens: bool
    node_2_imported_pages: int
    node_2_request_s: float
    block_size: int


# What only a cluster of several nodes exports (infra/ queries them too).
FETCH_METRICS = (
    "ray_moe_cluster_kv_fetches_total",
    "ray_moe_cluster_kv_fetched_bytes_total",
    "ray_moe_cluster_kv_fetch_seconds_count",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fetch_metrics(port: int) -> dict[str, list[str]]:
    """Node 2's fetch samples on its metrics endpoint, once all three are there
    (Ray's agent exports every few seconds)."""
    import httpx

    names = FETCH_METRICS

    def samples() -> dict[str, list[str]]:
        try:
            body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        got = {
            n: [ln for ln in body.splitlines() if ln.startswith(n + "{")] for n in names
        }
        return got if all(got.values()) else {}

    try:
        return dict(wait_until(samples, 60, "node 2's fetch metrics"))
    except AssertionError:
        return {}


def main() -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node-1": 1}},
    )
    metrics_port = free_port()
    cluster.add_node(
        num_cpus=1, resources={"node-2": 1}, metrics_export_port=metrics_port
    )
    # (one CPU each: an engine per node)
    ray.init(address=cluster.address, namespace=kv_actor.NAMESPACE)
    cluster.wait_for_nodes()
    by_res = {
        next(r for r in n["Resources"] if r.startswith("node-")): n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
    }
    n1, n2 = by_res["node-1"], by_res["node-2"]
    s1 = kv_actor.get_or_create_store(APP, n1, STORE)
    s2 = kv_actor.get_or_create_store(APP, n2, STORE)
    sock1, sock2 = ray.get([s1.start.remote(), s2.start.remote()])

    c1, c2 = StoreClient(sock1), StoreClient(sock2)
    i1, i2 = c1.open(PAGE, "tiny"), c2.open(PAGE, "tiny")
    a1 = Arena.attach(i1.name, i1.num_pages, i1.page_bytes)
    a2 = Arena.attach(i2.name, i2.num_pages, i2.page_bytes)
    hashes = list(block_hashes(list(range(PAGES * 16 + 1)), 16))
    rows = np.random.default_rng(0).integers(0, 255, (PAGES, PAGE), dtype=np.uint8)
    slots = c1.reserve(hashes).slots
    c1.commit(
        [
            Written(s, a1.write(s, rows[i]))
            for i, s in enumerate(slots)
            if s is not None
        ],
        a1.name,
    )

    t0 = time.monotonic()
    pending_answers = 0
    fetch: Fetch | None = None

    def found() -> list[Any]:
        # As vLLM's scheduler does: ask again while the answer is "pending".
        nonlocal pending_answers, fetch
        answer = c2.lookup(Query("req", hashes, "", [], 16, 0))
        pending_answers += answer.pending
        fetch = answer.fetch
        return answer.refs

    refs = wait_until(found, 10, "node 2 to find node 1's pages")
    fetch_s = time.monotonic() - t0
    equal = len(refs) == PAGES and all(
        np.array_equal(a2.page(r.slot), rows[i]) for i, r in enumerate(refs)
    )
    where = {
        "node-1": ray.get(s1.summary.remote())["node"] == n1,
        "node-2": ray.get(s2.summary.remote())["node"] == n2,
    }
    summary2 = ray.get(s2.summary.remote())
    c2.release("req")
    results: list[Any] = [
        Fetched(
            found=len(refs),
            pending_answers=pending_answers,
            seconds=round(fetch_s, 3),
            bytes_equal=equal,
            imported_pages=summary2["imported_pages"],
            stores_on_their_nodes=where,
            distinct_arenas=a1.name != a2.name,
            fetch=fetch,
            metrics=fetch_metrics(metrics_port),
        )
    ]
    a1.close()
    a2.close()
    if len(sys.argv) > 2:
        # Fresh stores: the engines' pages are of another layout than the above.
        e1 = kv_actor.get_or_create_store(ENGINES, n1, ENGINE_STORE)
        e2 = kv_actor.get_or_create_store(ENGINES, n2, ENGINE_STORE)
        socks = ray.get([e1.start.remote(), e2.start.remote()])
        results.append(engines(sys.argv[2], *socks, e2, n1))
        kv_actor.kill(ENGINES)
    with open(sys.argv[1], "wb") as f:
        pickle.dump(results, f)
    kv_actor.kill(APP)
    ray.shutdown()
    cluster.shutdown()


class Engine:
    """A vLLM engine with the page-store connector, on one node."""

    def __init__(self, model: str, socket: str) -> None:
        from vllm import LLM

        from kvstore.connector import transfer_config

        self.llm = LLM(
            model=model,
            attention_backend=PLATFORM.vllm_backend,
            dtype=PLATFORM.dtype,
            block_size=PLATFORM.block_size,
            max_model_len=2048,
            kv_cache_memory_bytes=32 << 20,
            enforce_eager=True,
            kv_transfer_config=transfer_config(socket),
        )

    def block_size(self) -> int:
        return int(self.llm.llm_engine.vllm_config.cache_config.block_size)

    def generate(self, prompt: list[int]) -> tuple[list[int], int, float]:
        from vllm import SamplingParams

        t = time.perf_counter()
        out = self.llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=8, temperature=0.0),
            use_tqdm=False,
        )[0]
        took = time.perf_counter() - t
        return list(out.outputs[0].token_ids), out.num_cached_tokens or 0, took


def engines(model: str, sock1: str, sock2: str, store2: Any, node1: str) -> EnginesRun:
    cls = ray.remote(num_cpus=1)(Engine)
    e1 = cls.options(resources={"node-1": 1}).remote(model, sock1)
    e2 = cls.options(resources={"node-2": 1}).remote(model, sock2)
    prompt = list(range(3, 3 + ENGINE_BLOCKS * PLATFORM.block_size + 1))  # + 1 token
    before = ray.get(store2.summary.remote())["imported_pages"]
    tokens1, cached1, _ = ray.get(e1.generate.remote(prompt))
    wait_until(  # node 1's pages reached the directory, and node 2's mirror of it
        lambda: (
            ray.get(store2.summary.remote())["mirror"].get(node1, 0) >= ENGINE_BLOCKS
        ),
        10,
        "node 2's store to know node 1's pages",
    )
    tokens2, cached2, seconds2 = ray.get(e2.generate.remote(prompt))
    after = ray.get(store2.summary.remote())["imported_pages"]
    return EnginesRun(
        node_1_cached=cached1,
        node_2_cached=cached2,
        same_tokens=tokens1 == tokens2,
        node_2_imported_pages=after - before,
        node_2_request_s=round(seconds2, 3),
        block_size=ray.get(e2.block_size.remote()),
    )


if __name__ == "__main__":
    # The importable module's main: what it pickles then names that module.
    from tests.kvstore import two_nodes

    two_nodes.main()
