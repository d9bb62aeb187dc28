from kvstore.block_hash import BlockHash
from router.prefix import PrefixDirectory
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
