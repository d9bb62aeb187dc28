from kvstore.block_hash import BlockHash
from kvstore.node_store import Changes
from router.prefix import PrefixDirectory, PrefixView
from router.types import KVEvent, ReplicaId


def test_directory_longest_prefix_and_removal() -> None:
    h = [BlockHash(bytes([i]) * 32) for i in range(4)]
    r1, r2 = ReplicaId("r1"), ReplicaId("r2")
    d = PrefixDirectory()
    d.apply(r1, [KVEvent("stored", (h[0], h[1], h[2]))])
    d.apply(r2, [KVEvent("stored", (h[0],)), KVEvent("stored", (h[2],))])
    assert d.cached_blocks(r1, h) == 3
    assert d.cached_blocks(r2, h) == 1  # h[2] without h[1] is no prefix
    d.apply(r1, [KVEvent("removed", (h[1],))])
    assert d.cached_blocks(r1, h) == 1
    d.apply(r2, [KVEvent("cleared")])
    assert d.cached_blocks(r2, h) == 0 and d.num_blocks(r2) == 0
    d.forget(r1)
    assert d.num_blocks(r1) == 0


def test_a_replica_serves_its_engines_blocks_and_its_node_stores_pages() -> None:
    h = [BlockHash(bytes([i]) * 32) for i in range(4)]
    r1, r2 = ReplicaId("r1"), ReplicaId("r2")
    view = PrefixView()
    view.engines.apply(r1, [KVEvent("stored", (h[0],))])
    view.follow_stores(Changes(2, True, (("n1", h[1]), ("n2", h[0]))))
    # r1's engine has h0, its node's store h1; r2's node store has only h0.
    assert view.cached_blocks(r1, "n1", h) == 2
    assert view.cached_blocks(r2, "n2", h) == 1
    assert view.cached_blocks(r2, "", h) == 0  # node unknown: its engine only
    view.follow_stores(Changes(4, False, (("n1", h[2]),), (("n2", h[0]),)))
    assert view.cached_blocks(r1, "n1", h) == 3
    assert view.cached_blocks(r2, "n2", h) == 0
    # The directory restarted (or the router fell behind): all of it again.
    view.follow_stores(Changes(1, True, (("n2", h[0]),)))
    assert view.cached_blocks(r1, "n1", h) == 1
    assert view.stores.summary() == {"n2": 1}
