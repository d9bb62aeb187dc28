"""A page held on node 1 is fetched by node 2: two Ray nodes started in-process.

    .venv/bin/python -m tests.kvstore.two_nodes      # prints one JSON line

Each node runs its own store actor and arena. An "engine" on node 1 (a store
client, as the connector is) writes a prompt's pages; one on node 2 looks the
prompt up, is told to wait while its store fetches the pages from node 1's, then
finds them locally. Run in its own process by ``test_two_nodes`` (a process can
join only one Ray cluster).
"""

from __future__ import annotations

import json
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

from kvstore import actor as kv_actor
from kvstore.arena import Arena
from kvstore.rpc import StoreClient
from router.prefix import block_hashes

APP = "two-nodes"
PAGE = 147456  # one tiny-model page
PAGES = 8


def main() -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node-1": 1}},
    )
    cluster.add_node(num_cpus=1, resources={"node-2": 1})
    ray.init(address=cluster.address, namespace=kv_actor.NAMESPACE)
    cluster.wait_for_nodes()
    by_res = {
        next(r for r in n["Resources"] if r.startswith("node-")): n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
    }
    n1, n2 = by_res["node-1"], by_res["node-2"]
    s1 = kv_actor.get_or_create_store(APP, n1, 64 * PAGE, sync_interval_s=0.1)
    s2 = kv_actor.get_or_create_store(APP, n2, 64 * PAGE, sync_interval_s=0.1)
    sock1, sock2 = ray.get([s1.start.remote(), s2.start.remote()])

    c1, c2 = StoreClient(sock1), StoreClient(sock2)
    a1 = Arena.attach(*c1.call("open", PAGE, "tiny"))
    a2 = Arena.attach(*c2.call("open", PAGE, "tiny"))
    hashes = list(block_hashes(list(range(PAGES * 16 + 1)), 16))
    rows = np.random.default_rng(0).integers(0, 255, (PAGES, PAGE), dtype=np.uint8)
    slots = c1.call("reserve", hashes)
    c1.call("commit", [[s, a1.write(s, rows[i])] for i, s in enumerate(slots)])

    t0 = time.monotonic()
    waits = 0
    while True:
        refs, pending = c2.call("lookup", "req", hashes, "", [], 16, True)
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
    kv_actor.kill(APP)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
