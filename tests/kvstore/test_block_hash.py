"""vLLM's chained block hash, against vLLM's own code."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.block_hash import block_hashes, none_hash


@pytest.fixture
def vllm_hashing() -> Iterator[Any]:
    """vLLM's hashing module, its NONE_HASH re-derived from the environment the
    test sets (and again from the restored one afterwards)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kv

    kv.init_none_hash(sha256)
    yield kv
    kv.init_none_hash(sha256)


def _vllm_chain(kv: Any, tokens: list[int], block: int) -> list[bytes]:
    from vllm.utils.hashing import sha256

    parent, out = None, []
    for start in range(0, len(tokens) - block + 1, block):
        parent = kv.hash_block_tokens(sha256, parent, tokens[start : start + block])
        out.append(bytes(parent))
    return out


def test_hashes_match_vllm(vllm_hashing: Any) -> None:
    from vllm.utils.hashing import sha256

    kv = vllm_hashing
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


def test_tenant_salt_matches_vllm_cache_salt_and_isolates_tenants(
    vllm_hashing: Any,
) -> None:
    from vllm.utils.hashing import sha256

    kv = vllm_hashing
    tokens = list(range(32))
    first = kv.hash_block_tokens(sha256, None, tokens[:16], (("cache_salt", "a"),))
    second = kv.hash_block_tokens(sha256, first, tokens[16:32])
    assert block_hashes(tokens, 16, salt="a") == (bytes(first), bytes(second))
    plain, other = block_hashes(tokens, 16), block_hashes(tokens, 16, salt="b")
    a = block_hashes(tokens, 16, salt="a")
    assert not set(a) & set(plain) and not set(a) & set(other)


def test_pythonhashseed_seeds_the_chain_as_it_seeds_vllms(
    monkeypatch: pytest.MonkeyPatch, vllm_hashing: Any
) -> None:
    from vllm.utils.hashing import sha256

    tokens = list(range(200, 248))  # 3 blocks of 16
    default = block_hashes(tokens, 16)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    vllm_hashing.init_none_hash(sha256)
    seeded = block_hashes(tokens, 16)
    assert list(seeded) == _vllm_chain(vllm_hashing, tokens, 16)
    assert seeded != default and none_hash() == none_hash("1234")
    monkeypatch.delenv("PYTHONHASHSEED")
    vllm_hashing.init_none_hash(sha256)
    assert list(block_hashes(tokens, 16)) == _vllm_chain(vllm_hashing, tokens, 16)
