"""A page held on node 1 is fetched by node 2: two Ray nodes started in-process.

    .venv/bin/python -m tests.kvstore.two_nodes [MODEL_DIR]   # prints JSON lines

Each node runs its own store actor and arena.

1. Stores: a client on node 1 (as the connector is) writes a prompt's pages; one on
   node 2 looks the prompt up, is told to wait while its store fetches the pages
   from node 1's, then finds them locally.
2. Engines (with MODEL_DIR): a vLLM engine on each node, each with the connector to
   its node's store. Node 1's engine computes a prompt; node 2's engine, asked the
   same prompt, loads it (fetched across nodes) instead of recomputing it.

Run in its own process by ``test_two_nodes`` (a process joins one Ray cluster).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from cluster.config import KVStoreConfig
from kvstore import actor as kv_actor
from kvstore.arena import Arena
from kvstore.block_hash import block_hashes
from kvstore.rpc import StoreClient

# The engines run what the test session's do (auto, or MOE_CLUSTER_TEST_BACKEND).
from tests.integration.conftest import PLATFORM

APP = "two-nodes"
ENGINES = "two-nodes-engines"
PAGE = 147456  # one tiny-model page
PAGES = 8
STORE = KVStoreConfig(capacity_bytes=64 * PAGE, sync_interval_s=0.1)
ENGINE_BLOCKS = 6  # full blocks of the prompt node 1 computes and node 2 loads
ENGINE_STORE = KVStoreConfig(capacity_bytes=64 << 20, sync_interval_s=0.1)


def main() -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node-1": 1}},
    )
    cluster.add_node(num_cpus=1, resources={"node-2": 1})
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
    a1 = Arena.attach(*c1.call("open", PAGE, "tiny"))
    a2 = Arena.attach(*c2.call("open", PAGE, "tiny"))
    hashes = list(block_hashes(list(range(PAGES * 16 + 1)), 16))
    rows = np.random.default_rng(0).integers(0, 255, (PAGES, PAGE), dtype=np.uint8)
    slots, _ = c1.call("reserve", hashes)
    c1.call("commit", [[s, a1.write(s, rows[i])] for i, s in enumerate(slots)])

    t0 = time.monotonic()
    waits = 0
    while True:
        refs, pending, _ = c2.call("lookup", "req", hashes, "", [], 16)
        if refs or (not pending and time.monotonic() - t0 > 10):
            break
        waits += pending
        time.sleep(0.01)
    fetch_s = time.monotonic() - t0
    equal = len(refs) == PAGES and all(
        np.array_equal(a2.page(slot), rows[i]) for i, (slot, _, _) in enumerate(refs)
    )
    where = {
        "node-1": ray.get(s1.summary.remote())["node"] == n1,
        "node-2": ray.get(s2.summary.remote())["node"] == n2,
    }
    summary2 = ray.get(s2.summary.remote())
    c2.call("release", "req")
    print(
        json.dumps(
            {
                "found": len(refs),
                "pending_answers": waits,
                "seconds": round(fetch_s, 3),
                "bytes_equal": equal,
                "imported_pages": summary2["imported_pages"],
                "stores_on_their_nodes": where,
                "distinct_arenas": a1.name != a2.name,
            }
        ),
        flush=True,
    )
    a1.close()
    a2.close()
    if len(sys.argv) > 1:
        # Fresh stores: the engines' pages are of another layout than the above.
        e1 = kv_actor.get_or_create_store(ENGINES, n1, ENGINE_STORE)
        e2 = kv_actor.get_or_create_store(ENGINES, n2, ENGINE_STORE)
        socks = ray.get([e1.start.remote(), e2.start.remote()])
        print(json.dumps(engines(sys.argv[1], *socks, e2)), flush=True)
        kv_actor.kill(ENGINES)
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


def engines(model: str, sock1: str, sock2: str, store2: Any) -> dict[str, Any]:
    cls = ray.remote(num_cpus=1)(Engine)
    e1 = cls.options(resources={"node-1": 1}).remote(model, sock1)
    e2 = cls.options(resources={"node-2": 1}).remote(model, sock2)
    prompt = list(range(3, 3 + ENGINE_BLOCKS * PLATFORM.block_size + 1))  # + 1 token
    before = ray.get(store2.summary.remote())["imported_pages"]
    tokens1, cached1, _ = ray.get(e1.generate.remote(prompt))
    time.sleep(0.5)  # node 1's pages reach the directory, and node 2's mirror
    tokens2, cached2, seconds2 = ray.get(e2.generate.remote(prompt))
    after = ray.get(store2.summary.remote())["imported_pages"]
    return {
        "engine_node_1_cached": cached1,
        "engine_node_2_cached": cached2,
        "same_tokens": tokens1 == tokens2,
        "engine_node_2_imported_pages": after - before,
        "engine_node_2_request_s": round(seconds2, 3),
        "block_size": ray.get(e2.block_size.remote()),
    }


if __name__ == "__main__":
    main()
