from router.prefix import PrefixDirectory, block_hashes
from router.types import BlockHash, KVEvent, ReplicaId


def test_hashes_match_vllm() -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kv

    kv.init_none_hash(sha256)
    tokens = list(range(100, 137))  # two full blocks of 16 and a partial one
    parent = None
    expected = []
    for start in (0, 16):
        parent = kv.hash_block_tokens(sha256, parent, tokens[start : start + 16])
        expected.append(bytes(parent))
    assert list(block_hashes(tokens, 16)) == expected
    assert block_hashes(tokens[:15], 16) == ()


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]
    assert block_hashes([1] * 16, 16, seed="x") != block_hashes([1] * 16, 16)


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


def test_tenant_salt_matches_vllm_cache_salt_and_isolates_tenants() -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kv

    kv.init_none_hash(sha256)
    tokens = list(range(32))
    first = kv.hash_block_tokens(sha256, None, tokens[:16], (("cache_salt", "a"),))
    second = kv.hash_block_tokens(sha256, first, tokens[16:32])
    assert block_hashes(tokens, 16, salt="a") == (bytes(first), bytes(second))
    plain, other = block_hashes(tokens, 16), block_hashes(tokens, 16, salt="b")
    a = block_hashes(tokens, 16, salt="a")
    assert not set(a) & set(plain) and not set(a) & set(other)
